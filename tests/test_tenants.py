"""Tenant isolation by ``cache_salt`` on the torch engine and the drop-ins (the vLLM connector: test_vllm.py).

Chunks are stored and reused within one salt and never across: another tenant (or no tenant) neither reuses
them nor gets them through a key it learned; the key itself differs, so it tells nothing without the salt."""
import pytest

from speccache_rag import RAGPrompt, ReuseConfig, SpecCacheEngine
from speccache_rag.kv import chunk_key, tenant_fingerprint
from speccache_rag.prompt import tokenize_piece

CHUNKS = ["The Kettlewick Cooperative was founded in 1931 and packs smoked mackerel for 212 members.",
          "The cooperative's boats land their catch at Haskett Yard every morning before six."]
QUESTION = "How many members does the Kettlewick Cooperative have?"


@pytest.fixture(scope="module")
def engine(smollm2):
    model, tok = smollm2
    eng = SpecCacheEngine(model, tok, store="memory://", name="smollm2-135m", fill_misses=False)
    eng.precompute(CHUNKS, cache_salt="tenant-a")
    return eng


def _hits(engine, salt):
    out = engine.generate(RAGPrompt(chunks=CHUNKS, question=QUESTION), max_new_tokens=1,
                          reuse=ReuseConfig(method="reuse"), cache_salt=salt)
    return out.stats.cache_hits


def test_chunks_are_reused_within_a_salt_and_never_across(engine):
    assert _hits(engine, "tenant-a") == len(CHUNKS)
    assert _hits(engine, "tenant-b") == 0
    assert _hits(engine, None) == 0                          # unsalted requests are a tenant of their own


def test_a_tenants_keys_differ_from_anothers_and_from_the_plain_ones(engine):
    ids, _ = tokenize_piece(engine.tokenizer, CHUNKS[0])
    keys = {salt: chunk_key(tenant_fingerprint(engine.fingerprint, salt), ids) for salt in (None, "a", "b")}
    assert len(set(keys.values())) == 3
    assert engine.precompute(CHUNKS[:1], cache_salt="tenant-a") == [
        chunk_key(tenant_fingerprint(engine.fingerprint, "tenant-a"), ids)]
    from speccache_rag.store.admin import verify

    report = verify(engine.store, [engine.fingerprint])        # a tenant's entries belong to its model
    assert report.checked >= len(CHUNKS) and not report.unknown_model and not report.corrupt
    with pytest.raises(ValueError, match="cache_salt"):
        engine.generate(RAGPrompt(chunks=CHUNKS, question=QUESTION), max_new_tokens=1, cache_salt="")


def test_the_drop_ins_carry_the_salt_per_instance_and_per_call(engine):
    pytest.importorskip("langchain_core")
    from langchain_speccache import ChatSpecCache

    prompt = [("system", "Context:\n" + "\n\n".join(CHUNKS)), ("human", QUESTION)]
    owner = ChatSpecCache(engine=engine, cache_salt="tenant-a", max_tokens=1, method="reuse")
    owner.precompute(CHUNKS)                 # under tenant-a, and the engine's text index learns them
    assert owner.invoke(prompt).usage_metadata["input_token_details"]["cache_read"] > 0
    other = ChatSpecCache(engine=engine, cache_salt="tenant-b", max_tokens=1, method="reuse")
    assert other.invoke(prompt).usage_metadata["input_token_details"]["cache_read"] == 0
    assert owner.invoke(prompt, cache_salt="tenant-b").usage_metadata["input_token_details"]["cache_read"] == 0
