"""Bad input gets a clear error and loses nothing."""
import warnings
from pathlib import Path

import pytest

from speccache_rag import RAGPrompt, ReuseConfig, SpecCacheEngine
from speccache_rag.kv import chunk_key
from tiny_models import tiny_random_model

CHUNKS = ["Tollund Vane brews amber cider in the village of Harrowmere since 1911.",
          "Harrowmere lies two valleys west of Quendal, on the old salt road.",
          "The cider press at Harrowmere was rebuilt in 1954 after a flood."]
QUESTION = "Since when does Tollund Vane brew cider?"


@pytest.fixture()
def disk_engine(smollm2, tmp_path):
    model, tok = smollm2
    return SpecCacheEngine(model, tok, store=tmp_path / "kv")


def test_empty_question_is_rejected():
    for q in ["", "   \n"]:
        with pytest.raises(ValueError, match="question is empty"):
            RAGPrompt(chunks=CHUNKS, question=q)


def test_prompt_longer_than_context_window(disk_engine):
    huge = "lorem ipsum dolor " * (disk_engine.context_window // 2)
    with pytest.raises(ValueError, match="exceeds the context window"):
        disk_engine.generate(RAGPrompt(chunks=[huge], question=QUESTION), max_new_tokens=4)
    assert disk_engine.store.keys() == []                           # nothing was half-stored


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match="smollm2-135m"):
        SpecCacheEngine.from_pretrained("no-such-model-7b", store="memory://")


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        SpecCacheEngine.from_pretrained("smollm2-135m", store="memory://", backend="tensorrt")


def test_corrupt_store_entry_is_a_miss_then_recomputed(disk_engine):
    keys = disk_engine.precompute(CHUNKS)
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    clean = disk_engine.generate(prompt, max_new_tokens=8, reuse=ReuseConfig(method="reuse"))
    victim = next(Path(disk_engine.store.root).rglob(f"{keys[1]}*"))
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF                                              # flip a byte inside the tensors
    victim.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="checksum|corrupt|unreadable"):
        hurt = disk_engine.generate(prompt, max_new_tokens=8, reuse=ReuseConfig(method="reuse"))
    assert (hurt.stats.cache_hits, hurt.stats.cache_misses) == (2, 1)
    # the missed chunk was recomputed in full, and stored again for next time
    assert hurt.stats.recomputed_tokens > clean.stats.recomputed_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = disk_engine.generate(prompt, max_new_tokens=8, reuse=ReuseConfig(method="reuse"))
    assert (again.stats.cache_hits, again.stats.cache_misses) == (3, 0)
    assert again.token_ids == clean.token_ids


def test_store_shared_by_two_models_never_crosses(smollm2, tmp_path):
    model, tok = smollm2
    other, _ = tiny_random_model("llama", tokenizer=tok)
    a = SpecCacheEngine(model, tok, store=tmp_path / "kv")
    b = SpecCacheEngine(other, tok, store=a.store)
    a.precompute(CHUNKS)
    ids = tok(CHUNKS[0], add_special_tokens=False)["input_ids"]
    assert chunk_key(a.fingerprint, ids) != chunk_key(b.fingerprint, ids)
    out = b.generate(RAGPrompt(chunks=CHUNKS, question=QUESTION), max_new_tokens=2, reuse=ReuseConfig(method="reuse"))
    assert (out.stats.cache_hits, out.stats.cache_misses) == (0, 3)


def test_redis_down_degrades_to_full_prefill(smollm2):
    model, tok = smollm2
    with pytest.warns(UserWarning, match="unreachable"):
        engine = SpecCacheEngine(model, tok, store="redis://127.0.0.1:1/0")
    engine.precompute(CHUNKS)                                       # dropped, not raised
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    out = engine.generate(prompt, max_new_tokens=6, reuse=ReuseConfig(method="speccache"))
    full = engine.generate(prompt, max_new_tokens=6, reuse=ReuseConfig(method="full"))
    assert out.stats.cache_misses == 3 and out.stats.recomputed_tokens == out.stats.prompt_tokens
    assert out.token_ids == full.token_ids
