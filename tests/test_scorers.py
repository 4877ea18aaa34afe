"""Scorers and chunk-KV policies of the quality work: question rows, the prefix sink, the adaptive budget."""
import dataclasses

import pytest
import torch

from speccache_rag import RAGPrompt, ReuseConfig, SpecCacheEngine
from speccache_rag.layers import HFLayers
from speccache_rag.models import load_tokenizer
from speccache_rag.prompt import render, sink_token_ids, tokenize_piece
from speccache_rag.runner import KVCache, full_prefill
from speccache_rag.selection import Selection, adaptive_budget, budget_for
from speccache_rag.selection.speccache import draft_question_rows
from speccache_rag.selection.deviation import deviation_scores
from speccache_rag.selection.qattn import question_rows

CHUNKS = [
    "Zorblat Industries was founded in 1987 by Mira Quell in the town of Vessendorf.",
    "Mira Quell was born in 1950 in Ostrava and studied metallurgy before moving to Vessendorf.",
    "Vessendorf is a small town on the river Lenne, known for its annual kettle festival in August.",
]
QUESTION = "In which year was the founder of Zorblat Industries born?"


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_question_rows_are_the_tokens_after_the_last_chunk(name):
    tok = load_tokenizer(name)
    tokens = render(RAGPrompt(chunks=CHUNKS, question=QUESTION), tok)
    reusable = torch.zeros(len(tokens), dtype=torch.bool)
    for seg in tokens.chunk_segments():
        reusable[seg.start:seg.end] = True
    always = (~reusable).nonzero().flatten()
    rows = always[question_rows(Selection(tokens, reusable, 0, ReuseConfig()), always)]
    assert torch.equal(rows, draft_question_rows(tokens))            # the target's and the draft's rule agree
    text = tok.decode(tokens.token_ids[int(rows[0]):])
    assert QUESTION in text and CHUNKS[-1][-20:] not in text
    assert int(rows[0]) == tokens.chunk_segments()[-1].end and int(rows[-1]) == len(tokens) - 1


def test_scorers_fail_clearly_on_a_prompt_without_chunks(smollm2):
    model, tok = smollm2
    tokens = render(RAGPrompt(chunks=[], question=QUESTION), tok)
    none = torch.zeros(len(tokens), dtype=torch.bool)
    with pytest.raises(ValueError, match="needs a prompt with chunks"):
        question_rows(Selection(tokens, none, 0, ReuseConfig()), torch.arange(len(tokens)))
    with pytest.raises(ValueError, match="needs a prompt with chunks"):
        draft_question_rows(tokens)
    # the engine itself answers such a prompt: nothing to reuse, every token computed
    engine = SpecCacheEngine(model, tok, store="memory://")
    for method in ("qattn", "speccache", "norm", "deviation"):
        out = engine.generate(RAGPrompt(chunks=[], question=QUESTION), max_new_tokens=2,
                              reuse=ReuseConfig(method=method))
        assert out.stats.recomputed_tokens == out.stats.prompt_tokens


def test_prefix_policy_stores_the_chunk_as_read_behind_the_shared_prefix(smollm2):
    model, tok = smollm2
    engine = SpecCacheEngine(model, tok, store="memory://", sink="prefix")
    prefix = sink_token_ids(tok, "prefix")
    rendered = render(RAGPrompt(chunks=CHUNKS, question=QUESTION), tok)
    assert prefix == rendered.token_ids[:rendered.chunk_segments()[0].start]     # the template up to chunk 0
    [key] = engine.precompute(CHUNKS[:1])
    ids, _ = tokenize_piece(tok, CHUNKS[0])
    reference, _ = full_prefill(HFLayers(model), torch.tensor(prefix + ids), keep_pre_rope=True)
    stored = engine.store.get(key)
    torch.testing.assert_close(stored.k, reference.k_pre[:, :, len(prefix):], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stored.v, reference.v[:, :, len(prefix):], atol=1e-5, rtol=1e-5)
    # the prefix is part of the key: the bos policy keys the same chunk differently
    bos = SpecCacheEngine(model, tok, store="memory://")
    assert bos.precompute(CHUNKS[:1]) != [key]
    # in a prompt with the default system message, chunk 0 sits behind exactly that prefix: reused as is,
    # its KV equals full prefill's
    n = len(rendered)
    full, _ = full_prefill(engine.ops, rendered.ids)
    cache = KVCache.empty(engine.ops, n)
    reusable, _ = engine.blender.load(rendered, cache, engine_stats(n))
    seg = rendered.chunk_segments()[0]
    assert reusable[seg.start:seg.end].all()
    torch.testing.assert_close(cache.k[:, :, seg.start:seg.end], full.k[:, :, seg.start:seg.end], atol=1e-4, rtol=1e-4)


def engine_stats(n):
    from speccache_rag.output import GenerationStats

    return GenerationStats("reuse", n)


def test_auto_ratio_validation():
    assert ReuseConfig(recompute_ratio="auto").recompute_ratio == "auto"
    with pytest.raises(ValueError, match="recompute_ratio"):
        ReuseConfig(recompute_ratio="sometimes")
    with pytest.raises(ValueError, match="auto_range"):
        ReuseConfig(recompute_ratio="auto", auto_range=(0.3, 0.1))
    with pytest.raises(ValueError, match="needs a scoring method"):
        ReuseConfig(method="epic", recompute_ratio="auto")
    with pytest.raises(ValueError, match="needs a scoring method"):
        ReuseConfig(method="norm", recompute_ratio="auto")


def test_adaptive_budget_covers_the_score_mass_within_its_bounds():
    cfg = ReuseConfig(recompute_ratio="auto", auto_mass=0.5, auto_range=(0.05, 0.30))
    n = 200
    lo, hi = budget_for(0.05, n), budget_for(0.30, n)
    peaked = torch.zeros(n)
    peaked[:3] = 1.0                                  # all the mass on 3 tokens: the lower bound
    assert adaptive_budget(peaked, cfg) == lo
    flat = torch.ones(n)                              # half the mass needs half the tokens: the upper bound
    assert adaptive_budget(flat, cfg) == hi
    middle = torch.cat([torch.ones(170), torch.full((30,), 10.0)])  # half of 470 = 235: 24 tokens of 10
    assert adaptive_budget(middle, cfg) == 24
    fixed = ReuseConfig(recompute_ratio=0.15)
    assert adaptive_budget(flat, fixed) == budget_for(0.15, n)


@pytest.mark.parametrize("method", ["qattn", "speccache", "cacheblend"])
def test_auto_ratio_recomputes_within_its_bounds(smollm2, method):
    model, tok = smollm2
    engine = SpecCacheEngine(model, tok, store="memory://")
    engine.precompute(CHUNKS)
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    tokens = render(prompt, tok)
    reusable = sum(s.end - s.start for s in tokens.chunk_segments())
    always = len(tokens) - reusable
    cfg = ReuseConfig(method=method, recompute_ratio="auto", auto_range=(0.1, 0.2))
    out = engine.generate(prompt, max_new_tokens=2, reuse=cfg)
    chosen = out.stats.recomputed_tokens - always
    assert budget_for(0.1, reusable) <= chosen <= budget_for(0.2, reusable)


def test_deviation_measures_reused_chunks_against_the_chunk_read_alone(smollm2):
    model, tok = smollm2
    ops = HFLayers(model)
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    tokens = render(prompt, tok)
    segs = tokens.chunk_segments()
    reusable = torch.zeros(len(tokens), dtype=torch.bool)
    for seg in segs[:2]:                              # the third chunk missed the store: nothing to score there
        reusable[seg.start:seg.end] = True
    sel = Selection(tokens, reusable, 10, ReuseConfig(method="deviation"), prompt=prompt, draft=ops,
                    draft_tokenizer=tok)
    scores = deviation_scores(sel, tokens)
    assert all((scores[seg.start:seg.end] > 0).all() for seg in segs[:2])
    scored = torch.zeros(len(tokens), dtype=torch.bool)
    scored[segs[0].start:segs[0].end] = scored[segs[1].start:segs[1].end] = True
    assert not scores[~scored].any()
    # the last layer's residual of chunk 1's first token, in the prompt and alone after the sink
    seen: dict[int, torch.Tensor] = {}
    full_prefill(ops, tokens.ids, capture=seen)
    sink = sink_token_ids(tok)
    alone: dict[int, torch.Tensor] = {}
    full_prefill(ops, torch.tensor(sink + tokens.token_ids[segs[1].start:segs[1].end]), capture=alone)
    last = ops.num_layers - 1
    moved = (seen[last][segs[1].start] - alone[last][len(sink)]).norm()
    one_layer = deviation_scores(dataclasses.replace(sel, config=ReuseConfig(method="deviation",
                                                                              draft_layers=1 / ops.num_layers)),
                                 tokens)
    torch.testing.assert_close(one_layer[segs[1].start], moved, rtol=1e-4, atol=1e-4)


def test_deviation_reads_chunks_alone_under_the_engines_sink_policy(smollm2):
    """Under ``sink="prefix"`` a chunk is stored as read behind the template prefix, so the first chunk of a
    prompt with that prefix has not moved at all, while later chunks have; under "bos" the first moves too."""
    model, tok = smollm2
    ops = HFLayers(model)
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    tokens = render(prompt, tok)
    first, second = tokens.chunk_segments()[:2]
    reusable = torch.zeros(len(tokens), dtype=torch.bool)
    for seg in tokens.chunk_segments():
        reusable[seg.start:seg.end] = True
    moved = {}
    for sink in ("prefix", "bos"):
        sel = Selection(tokens, reusable, 10, ReuseConfig(method="deviation"), prompt=prompt, draft=ops,
                        draft_tokenizer=tok, sink=sink)
        scores = deviation_scores(sel, tokens)
        moved[sink] = (scores[first.start:first.end].mean(), scores[second.start:second.end].mean())
    assert moved["prefix"][0] < 1e-3 * moved["prefix"][1]
    assert moved["bos"][0] > 0.1 * moved["bos"][1]
    # and through the engine: a prefix-policy engine with one chunk missing the store answers with deviation
    engine = SpecCacheEngine(model, tok, store="memory://", sink="prefix", gate=False)
    assert engine.blender.sink == "prefix"
    engine.precompute(CHUNKS[:2])
    out = engine.generate(prompt, max_new_tokens=2, reuse=ReuseConfig(method="deviation"))
    assert out.stats.method == "deviation" and out.stats.cache_hits == 2 and out.stats.cache_misses == 1
    assert 0 < out.stats.recomputed_tokens < out.stats.prompt_tokens


def test_qattn_chunk_sinks_stay_inside_their_chunk_and_leave_the_probe_alone():
    """``qattn_sink`` boosts each chunk's first k tokens, never the tokens after a chunk shorter than k, and
    scoring does not rewrite the probe's accumulated attention."""
    from speccache_rag.selection.qattn import QuestionAttention, qattn_scores

    tok = load_tokenizer("smollm2-135m")
    tokens = render(RAGPrompt(chunks=["Short.", *CHUNKS], question=QUESTION), tok)
    short = tokens.chunk_segments()[0]
    k = short.end - short.start + 3
    sel = Selection(tokens, torch.ones(len(tokens), dtype=torch.bool), 10, ReuseConfig(qattn_sink=k))
    probe = QuestionAttention(torch.arange(0), torch.arange(0), range(1), 1.0, len(tokens))
    probe.scores = torch.rand(len(tokens))
    before = probe.scores.clone()
    boosted = (qattn_scores(probe, sel) > 100).nonzero().flatten().tolist()
    assert torch.equal(probe.scores, before)
    assert boosted == [p for s in tokens.chunk_segments() for p in range(s.start, min(s.end, s.start + k))]
    assert short.end not in boosted
