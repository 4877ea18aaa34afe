"""Session-wide fixtures shared by the test files."""
import shutil

import pytest

from redis_server import NO_REDIS_PY, free_port, start_redis, stop


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of the real SmolLM2-135M-Instruct, loaded once per session (float32)."""
    from speccache_rag.models import load

    return load("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_bf16():
    """The same model computing in bfloat16 (whatever ``dtype="auto"`` would pick on this machine)."""
    from speccache_rag.models import load

    return load("smollm2-135m", dtype="bfloat16")


@pytest.fixture(scope="session")
def demo_docs():
    """The embedded demo documents as ``[(file name, text), …]``, in file-name order."""
    from speccache_rag.data import demo_documents

    return demo_documents()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real, throwaway redis-server (no persistence) on a free port, for the whole session."""
    pytest.importorskip("redis", reason=NO_REDIS_PY)
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    yield f"redis://127.0.0.1:{port}/0"
    stop(proc)
