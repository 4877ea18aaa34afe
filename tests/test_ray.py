"""Distributed precompute on Ray Data (local Ray, 2 CPUs): idempotent, skips what the store holds."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the 'ray' extra is not installed: pip install 'speccache-rag[ray]'")

from speccache_rag.cli import main as cli  # noqa: E402
from speccache_rag.data import demo_dir  # noqa: E402
from speccache_rag.store import DiskStore, admin  # noqa: E402


@pytest.mark.timeout(900)
def test_a_ray_precompute_killed_halfway_leaves_a_consistent_store_and_the_rerun_computes_only_the_rest(tmp_path):
    """`kill -9` of the whole job (driver, its local Ray cluster, the actors) while entries are being
    written; runs first, before this module's own Ray instance exists, so the job has its own cluster."""
    store = tmp_path / "kv"
    cmd = [str(Path(sys.executable).parent / "speccache-rag"), "precompute", str(demo_dir()), "--store", str(store),
           "--target", "smollm2-135m", "--ray", "--dtype", "float32"]
    job = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while len(list(store.rglob("*.safetensors"))) < 3:
        assert job.poll() is None and time.time() < deadline, "the Ray precompute ended before it could be killed"
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    time.sleep(3)                                       # anything still alive would go on writing
    before = set(DiskStore(store).keys())
    assert len(before) >= 3 and set(DiskStore(store).keys()) == before
    assert admin.verify(DiskStore(store)).ok            # whole entries only: never one half-written
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    m = re.search(r"(\d+) chunks: (\d+) new, (\d+) already stored, 0 failed", rerun.stdout)
    assert m, rerun.stdout[-2000:]
    total, new, stored = (int(g) for g in m.groups())
    assert stored == len(before) and new == total - len(before) > 0
    assert len(DiskStore(store).keys()) == total and admin.verify(DiskStore(store)).ok


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.timeout(900)
def test_ray_precompute_stores_every_chunk_once_and_a_rerun_skips_them(local_ray, tmp_path, capsys, smollm2):
    store = tmp_path / "kv"
    argv = ["precompute", str(demo_dir()), "--store", str(store), "--target", "smollm2-135m", "--ray",
            "--dtype", "float32"]
    assert cli(argv) == 0
    first = capsys.readouterr().out
    m = re.search(r"(\d+) chunks: (\d+) new, 0 already stored, 0 failed .* on 2 actor\(s\)", first)
    assert m and int(m.group(1)) == int(m.group(2)) > 4, first
    n = int(m.group(1))
    assert len(DiskStore(store).keys()) == n and admin.verify(DiskStore(store)).ok
    assert cli(argv) == 0
    assert f"{n} chunks: 0 new, {n} already stored, 0 failed" in capsys.readouterr().out
    # the local CLI, same chunks and model: nothing new either (same keys from both paths)
    assert cli(["precompute", str(demo_dir()), "--store", str(store), "--target", "smollm2-135m",
                "--dtype", "float32"]) == 0
    assert f"{n} chunks from" in (out := capsys.readouterr().out) and "0 new entries" in out


def test_ray_precompute_refuses_a_store_workers_cannot_share(local_ray, capsys):
    assert cli(["precompute", str(demo_dir()), "--store", "memory://", "--ray"]) == 2
    assert "shared directory or redis" in capsys.readouterr().err
