"""Models by Hugging Face id, from a Hugging Face cache built here, offline (no network is ever tried)."""
from __future__ import annotations

import contextlib
from io import StringIO
from pathlib import Path

import pytest
from tiny_models import tiny_random_model

from speccache_rag import cli, models
from speccache_rag.data import demo_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _place_in_cache(hub: Path, repo_id: str, save, revision: str = "main", commit: str = COMMIT):
    """What a download leaves in the cache: the snapshot of a commit and the ref that names it."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    save(snap)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in HF_HOME, offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model("llama", num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1)


def _save(tiny):
    model, tokenizer = tiny

    def save(path):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return save


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache(hf_cache, tiny):
    snap = _place_in_cache(hf_cache, "acme/tiny-llama", _save(tiny))
    assert models.resolve("acme/tiny-llama") == snap
    assert models.resolve(f"acme/tiny-llama@{COMMIT}") == snap        # a pinned revision
    model, tokenizer = models.load("acme/tiny-llama")
    assert model.config.model_type == "llama" and len(tokenizer) == len(tiny[1])


def test_a_hub_id_missing_offline_says_what_was_tried(hf_cache):
    with pytest.raises(FileNotFoundError, match=r"acme/absent is not a local path, nor in the Hugging Face cache at .*"
                                                r"HF_HUB_OFFLINE"):
        models.resolve("acme/absent")


def test_an_unsupported_architecture_from_the_hub_fails_before_weights_load(hf_cache):
    from transformers import GPT2Config

    _place_in_cache(hf_cache, "acme/gpt2-tiny", GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained)
    with pytest.raises(ValueError, match="llama, qwen2"):           # the snapshot holds no weights at all
        models.load("acme/gpt2-tiny")


def test_a_local_directory_named_like_a_hub_id_wins(tmp_path, monkeypatch, tiny):
    monkeypatch.chdir(tmp_path)
    _save(tiny)(tmp_path / "acme" / "tiny-llama")
    assert models.resolve("acme/tiny-llama").resolve() == (tmp_path / "acme" / "tiny-llama").resolve()


def test_ask_runs_offline_on_a_model_in_the_hugging_face_cache(hf_cache, tiny, tmp_path):
    _place_in_cache(hf_cache, "acme/tiny-llama", _save(tiny))
    out, err = StringIO(), StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["ask", "How many members does the Kettlewick Cooperative have?", "--docs", str(demo_dir()),
                         "--target", "acme/tiny-llama", "--store", str(tmp_path / "kv"), "--max-new-tokens", "3"])
    assert code == 0, err.getvalue()
    assert "loaded acme/tiny-llama" in err.getvalue() and "reused=" in err.getvalue()


def test_a_missing_gguf_path_is_not_taken_for_a_hub_id(hf_cache):
    with pytest.raises(FileNotFoundError, match="no such model file"):
        models.resolve("models/absent.gguf")
