"""Distributed precompute on Ray Data (local Ray, 2 CPUs): idempotent, skips what the store holds."""
import re

import pytest

ray = pytest.importorskip("ray", reason="the 'ray' extra is not installed: pip install 'speccache-rag[ray]'")

from speccache_rag.cli import main as cli  # noqa: E402
from speccache_rag.data import demo_dir  # noqa: E402
from speccache_rag.store import DiskStore, admin  # noqa: E402


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
