"""Session-wide fixtures shared by the test files."""
import pytest


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
