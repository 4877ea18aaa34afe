"""Ingestion-time context (FusionRAG variants): keys, index, choice, exactness and what a query reads."""
import pytest
import torch

from speccache_rag import RAGPrompt, ReuseConfig, SpecCacheEngine
from speccache_rag.gate import logits_mismatch
from speccache_rag.kv import chunk_key
from speccache_rag.neighbors import choose, context_ids, nearest, register, variants
from speccache_rag.prompt import tokenize_piece
from speccache_rag.store import open_store
from speccache_rag.store.admin import verify
from test_exactness import CHUNKS, QUESTION

# chunk i's neighbours: the other chunks about the same people and places
CONTEXT = [[CHUNKS[1], CHUNKS[2]], [CHUNKS[0]], [CHUNKS[3], CHUNKS[0]], [CHUNKS[2]]]


def test_nearest_ranks_by_cosine_and_never_returns_the_row_itself():
    e = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [-1.0, 0.0]])
    near = nearest(e, 2)
    assert near[0] == [1, 3] and near[2] == [3, 1] and near[4][0] in (2, 3)
    assert all(i not in row for i, row in enumerate(near))
    assert nearest(e[:1], 3) == [[]]
    with pytest.raises(ValueError, match="matrix"):
        nearest(torch.zeros(3), 1)


def test_the_variant_key_covers_the_context():
    assert chunk_key("fp", [1, 2, 3]) != chunk_key("fp", [1, 2, 3], [7])
    assert chunk_key("fp", [1, 2, 3], [7]) != chunk_key("fp", [1, 2, 3], [8])
    assert chunk_key("fp", [1, 2, 3], []) == chunk_key("fp", [1, 2, 3])


def test_choose_by_policy():
    store = open_store("memory://")
    register(store, "p" * 8, "v1", ["a", "b"])
    register(store, "p" * 8, "v2", ["c"])
    register(store, "p" * 8, "v2", ["c"])                      # idempotent
    assert [v["key"] for v in variants(store, "p" * 8)] == ["v1", "v2"]
    # preceding: only a variant whose whole context comes before the chunk, the largest such
    assert choose(store, "p" * 8, ["c"], {"a", "c"}, "preceding") == "v2"
    assert choose(store, "p" * 8, ["b", "c", "a"], {"a", "b", "c"}, "preceding") == "v1"
    assert choose(store, "p" * 8, ["a"], {"a", "b", "c"}, "preceding") is None
    # unseen: no context chunk after it in the prompt, at least one ahead (absent ones allowed)
    assert choose(store, "p" * 8, ["a"], {"a", "c"}, "unseen") == "v1"
    assert choose(store, "p" * 8, ["a"], {"a", "b", "c"}, "unseen") is None
    assert choose(store, "p" * 8, [], {"c", "x"}, "retrieved") == "v2"
    assert choose(store, "p" * 8, [], {"a", "b", "c"}, "retrieved") == "v1"
    assert choose(store, "p" * 8, [], {"x"}, "retrieved") is None
    assert choose(store, "p" * 8, [], {"x"}, "nearest") == "v1"
    assert choose(store, "p" * 8, ["a", "b"], {"a", "b"}, "off") is None
    assert choose(store, "q" * 8, ["a"], {"a"}, "nearest") is None    # no variants: the plain entry


@pytest.fixture(scope="module")
def engine(smollm2):
    model, tok = smollm2
    eng = SpecCacheEngine(model, tok, store="memory://", gate=False, warm_up=False)
    keys = eng.precompute(CHUNKS, context=CONTEXT, singles=False)      # each chunk's whole context only
    assert keys == eng.precompute(CHUNKS)                      # plain keys, idempotent
    return eng


def test_a_variant_is_the_chunk_prefilled_after_its_context(engine):
    ids, _ = tokenize_piece(engine.tokenizer, CHUNKS[1])
    ctx = context_ids(engine.tokenizer, CONTEXT[1])
    plain = engine.store.get(chunk_key(engine.fingerprint, ids))
    variant = engine.store.get(chunk_key(engine.fingerprint, ids, ctx))
    assert variant.token_ids == plain.token_ids and variant.meta["context_ids"] == ctx
    # the same chunk prefilled in one piece after sink + context: the variant's entries, keys before RoPE
    from speccache_rag.runner import full_prefill

    cache, _ = full_prefill(engine.ops, torch.tensor(engine.blender.sink_ids + ctx + ids), keep_pre_rope=True)
    start = len(engine.blender.sink_ids) + len(ctx)
    torch.testing.assert_close(variant.k, cache.k_pre[:, :, start:])
    torch.testing.assert_close(variant.v, cache.v[:, :, start:])
    assert (variant.v - plain.v).abs().max() > 1e-2           # it did read the context
    report = verify(engine.store)
    assert report.checked == 2 * len(CHUNKS) and not report.corrupt


def test_at_ratio_one_every_variant_policy_equals_full_prefill(engine):
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    full = engine.generate(prompt, max_new_tokens=8, reuse=ReuseConfig(method="full"), return_first_logits=True)
    # CHUNKS in order: chunks 1 and 3 have their whole context ahead of them
    for policy, read in (("preceding", 2), ("retrieved", len(CHUNKS)), ("nearest", len(CHUNKS)), ("off", 0)):
        out = engine.generate(prompt, max_new_tokens=8, return_first_logits=True,
                              reuse=ReuseConfig(recompute_ratio=1.0, neighbors=policy))
        assert out.stats.context_variants == read
        assert logits_mismatch(out.first_logits, full.first_logits, torch.float32) is None
        assert out.token_ids == full.token_ids


def test_a_query_reads_variants_only_where_it_retrieved_their_neighbours(engine):
    # chunk 3's only neighbour (chunk 2) is absent; chunk 0's first (chunk 1) is there
    prompt = RAGPrompt(chunks=[CHUNKS[0], CHUNKS[3], CHUNKS[1]], question=QUESTION)
    reuse = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method="reuse", neighbors="retrieved"),
                            return_first_logits=True)
    assert reuse.stats.context_variants == 2 and reuse.stats.cache_hits == 3
    ahead = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method="reuse", neighbors="preceding"))
    assert ahead.stats.context_variants == 1                   # chunk 1 only: its context, chunk 0, is ahead
    off = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method="reuse", neighbors="off"),
                          return_first_logits=True)
    assert off.stats.context_variants == 0
    assert (reuse.first_logits - off.first_logits).abs().max() > 1e-3
    near = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method="reuse", neighbors="nearest"))
    assert near.stats.context_variants == 3


def test_singles_give_a_prompt_with_part_of_the_context_ahead_a_variant_to_read(smollm2, engine):
    model, tok = smollm2
    eng = SpecCacheEngine(model, tok, store="memory://", gate=False, warm_up=False)
    eng.precompute(CHUNKS, context=CONTEXT)                             # singles: the default
    # chunks 0 and 2 have two neighbours: the pair and each alone; chunks 1 and 3 one, stored once
    assert verify(eng.store).checked == len(CHUNKS) + 3 + 1 + 3 + 1
    assert [len(v["context"]) for v in variants(eng.store, eng.precompute(CHUNKS[:1])[0])] == [2, 1, 1]
    # chunk 0 has only chunk 1 of its pair ahead: a single fits; chunk 2 has its whole pair ahead
    prompt = RAGPrompt(chunks=[CHUNKS[1], CHUNKS[0], CHUNKS[3], CHUNKS[2]], question=QUESTION)
    pairs_only = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method="reuse"))
    assert pairs_only.stats.context_variants == 1
    full = eng.generate(prompt, max_new_tokens=8, reuse=ReuseConfig(method="full"), return_first_logits=True)
    out = eng.generate(prompt, max_new_tokens=8, return_first_logits=True, reuse=ReuseConfig(recompute_ratio=1.0))
    assert out.stats.context_variants == 2
    assert logits_mismatch(out.first_logits, full.first_logits, torch.float32) is None
    assert out.token_ids == full.token_ids


def test_a_lost_variant_falls_back_to_the_plain_entry(smollm2):
    model, tok = smollm2
    eng = SpecCacheEngine(model, tok, store="memory://", gate=False, warm_up=False)
    eng.precompute(CHUNKS[:2], context=[[CHUNKS[1]], [CHUNKS[0]]])
    for v in variants(eng.store, eng.precompute(CHUNKS[:1])[0]):
        eng.store.delete(v["key"])
    out = eng.generate(RAGPrompt(chunks=CHUNKS[:2], question=QUESTION), max_new_tokens=1,
                       reuse=ReuseConfig(neighbors="retrieved"))
    assert out.stats.cache_hits == 2 and out.stats.context_variants == 1 and out.stats.cache_misses == 0


def test_precompute_context_errors(engine):
    with pytest.raises(ValueError, match="one list per text"):
        engine.precompute(CHUNKS[:2], context=[[CHUNKS[2]]])
    with pytest.raises(ValueError, match="non-empty"):
        engine.precompute(CHUNKS[:1], context=[[" "]])
    with pytest.raises(ValueError, match="neighbors must be one of"):
        ReuseConfig(neighbors="all")
