import pytest
import torch

from speccache_rag import RAGPrompt, ReuseConfig
from speccache_rag.models import load_tokenizer
from speccache_rag.prompt import render, retokenize, segments_from_spans
from speccache_rag.selection import SELECTORS, Selection, budget_for, top_positions
from speccache_rag.selection.static import epic_select, random_select
from speccache_rag.selection.draft_spans import expand, map_to_target, select_by_draft_scores, span_ids
from speccache_rag.selection.norm import norm_select

CHUNKS = [
    "Kettlewright Quorvane measured 3.75 kilograms; its hallmark reads QX-17/β and was stamped in Vessendorf.",
    "The chronometer's escapement—built by Ottoline Brückner-Saavedra—drifted 0.004 s per day (±0.001).",
    "def frobnicate(x):\n    return x ** 2  # squares the input\n\nprint(frobnicate(12))",
]


@pytest.mark.parametrize("ratio", [-0.01, 1.01, float("nan"), "0.5"])
def test_ratio_outside_unit_interval_is_rejected(ratio):
    with pytest.raises(ValueError, match="recompute_ratio"):
        ReuseConfig(recompute_ratio=ratio)


def test_unknown_method_is_rejected():
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        ReuseConfig(method="magic")


def test_budget_rounds_up_without_float_noise():
    assert budget_for(0.15, 100) == 15
    assert budget_for(0.15, 101) == 16
    assert budget_for(1.0, 37) == 37
    assert budget_for(0.0, 37) == 0


def test_top_positions_picks_best_candidates_sorted():
    scores = torch.tensor([9.0, 1.0, 5.0, 7.0, 3.0, 8.0])
    assert top_positions(scores, torch.tensor([1, 2, 3, 4, 5]), 2).tolist() == [3, 5]


def test_spans_cut_at_jumps_chunk_starts_and_cap():
    scores = torch.tensor([1.0, 1.1, 1.2, 3.0, 3.1, 1.0] + [1.0] * 5)
    cand = torch.arange(11)
    starts = torch.zeros(11, dtype=torch.bool)
    starts[[0, 8]] = True                                     # two chunks: [0, 8) and [8, 11)
    assert span_ids(scores, cand, starts, tau_smooth=0.4, max_span=16).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3]
    assert span_ids(scores, cand, starts, tau_smooth=0.4, max_span=2).tolist() == [0, 0, 1, 2, 2, 3, 3, 4, 5, 5, 6]


def test_expand_completes_mostly_selected_spans_first():
    scores = torch.tensor([5.0, 4.9, 1.0, 4.8, 0.5, 0.4, 0.3])
    spans = torch.tensor([0, 0, 0, 0, 1, 1, 1])             # 3 of 4 of the first span are in the top 3
    order = expand(scores, spans, k=3, tau_cover=0.7).tolist()
    assert order[:3] == [0, 1, 3]
    assert order[3] == 2                                     # completion outranks the higher-scored rest
    assert sorted(order) == list(range(7))
    assert expand(scores, None, k=3, tau_cover=0.7).tolist() == [0, 1, 3, 2, 4, 5, 6]


def _selection(tokens, ratio, **kw):
    reusable = torch.zeros(len(tokens), dtype=torch.bool)
    for s in tokens.chunk_segments():
        reusable[s.start:s.end] = True
    cfg = ReuseConfig(recompute_ratio=ratio, **kw)
    return Selection(tokens, reusable, budget_for(ratio, int(reusable.sum())), cfg)


def test_epic_takes_leading_tokens_of_each_chunk():
    tok = load_tokenizer("smollm2-135m")
    tokens = render(RAGPrompt(chunks=CHUNKS, question="What?"), tok)
    sel = _selection(tokens, 0.2, method="epic", epic_k=4)
    picked = epic_select(sel).tolist()
    assert picked == [p for s in tokens.chunk_segments() for p in range(s.start, s.start + 4)]
    auto = epic_select(_selection(tokens, 0.2, method="epic"))
    # the largest k within the budget: one more token per chunk would not fit
    assert sel.budget - len(CHUNKS) < len(auto) <= sel.budget and all(sel.reusable[auto])


def test_random_is_seeded_and_within_reusable():
    tok = load_tokenizer("smollm2-135m")
    tokens = render(RAGPrompt(chunks=CHUNKS, question="What?"), tok)
    a = random_select(_selection(tokens, 0.3, method="random", seed=3))
    b = random_select(_selection(tokens, 0.3, method="random", seed=3))
    c = random_select(_selection(tokens, 0.3, method="random", seed=4))
    assert a.tolist() == b.tolist() != c.tolist()
    assert _selection(tokens, 0.3).reusable[a].all()


@pytest.fixture(scope="module")
def two_tokenizers():
    return load_tokenizer("smollm2-135m"), load_tokenizer("qwen2.5-coder-0.5b")


def test_chunk_tokens_are_the_precomputed_tokens(two_tokenizers):
    for tok in two_tokenizers:
        tokens = render(RAGPrompt(chunks=CHUNKS, question="What?"), tok)
        for seg in tokens.chunk_segments():
            alone = tok(CHUNKS[seg.chunk], add_special_tokens=False)["input_ids"]
            assert tokens.token_ids[seg.start:seg.end] == alone
        assert tok.decode(tokens.token_ids) == tok.apply_chat_template(
            [{"role": "system", "content": RAGPrompt.system},
             {"role": "user", "content": RAGPrompt(chunks=CHUNKS, question="What?").user_message(CHUNKS)}],
            tokenize=False, add_generation_prompt=True)


def test_cross_tokenizer_mapping_by_character_offsets(two_tokenizers):
    smol, qwen = two_tokenizers
    prompt = RAGPrompt(chunks=CHUNKS, question="What?")
    draft, target = render(prompt, smol), render(prompt, qwen)
    d_chunks = {s.chunk: s for s in draft.chunk_segments()}
    t_chunks = {s.chunk: s for s in target.chunk_segments()}
    # the two tokenizers really cut these chunks differently
    assert any(len(d_chunks[c].offsets) != len(t_chunks[c].offsets) for c in d_chunks)
    pd, pt = map_to_target(draft, target)
    mapping: dict[int, list[int]] = {}
    for d, t in zip(pd.tolist(), pt.tolist()):
        mapping.setdefault(d, []).append(t)
    covered = set()
    for c, ds in d_chunks.items():
        ts = t_chunks[c]
        for j, (a, b) in enumerate(ds.offsets):
            for t in mapping.get(ds.start + j, []):
                ta, tb = ts.offsets[t - ts.start]
                assert ts.start <= t < ts.end and ta < b and a < tb      # same chunk, overlapping characters
            covered.update(mapping.get(ds.start + j, []))
    every_target_chunk_token = {p for s in t_chunks.values() for p in range(s.start, s.end)}
    assert covered == every_target_chunk_token
    # a word cut differently maps onto exactly the target tokens that spell it
    word = "Brückner-Saavedra"
    ds, ts = d_chunks[1], t_chunks[1]
    at = CHUNKS[1].index(word)
    d_pos = [ds.start + j for j, (a, b) in enumerate(ds.offsets) if a < at + len(word) and at < b]
    t_pos = {ts.start + j for j, (a, b) in enumerate(ts.offsets) if a < at + len(word) and at < b}
    assert {t for d in d_pos for t in mapping.get(d, [])} == t_pos


def test_draft_selection_follows_scores_within_budget(two_tokenizers):
    """The best-scored draft word lands in the target selection; the budget is exact; only reused tokens."""
    smol, qwen = two_tokenizers
    prompt = RAGPrompt(chunks=CHUNKS, question="What?")
    draft, target = render(prompt, smol), render(prompt, qwen)
    sel = _selection(target, 0.1)
    sel.reusable[target.chunk_segments()[2].start:target.chunk_segments()[2].end] = False   # chunk 2 missed
    sel.budget = budget_for(0.1, int(sel.reusable.sum()))
    ds, ts = draft.chunk_segments()[1], target.chunk_segments()[1]
    word = CHUNKS[1].index("Brückner")
    scores = torch.ones(len(draft))
    hot = [ds.start + j for j, (a, b) in enumerate(ds.offsets) if a < word + 8 and word < b]
    scores[hot] = 10.0
    scores[draft.chunk_segments()[2].start:draft.chunk_segments()[2].end] = 100.0        # a missed chunk never wins
    chosen = select_by_draft_scores(sel, draft, scores)
    assert chosen.numel() == sel.budget and sel.reusable[chosen].all()
    spelled = {ts.start + j for j, (a, b) in enumerate(ts.offsets) if a < word + 8 and word < b}
    assert spelled <= set(chosen.tolist())


def test_question_rows_are_everything_after_the_last_chunk(two_tokenizers):
    from speccache_rag.selection.qattn import question_rows

    question = "Who built the chronometer's escapement?"
    for tok in two_tokenizers:
        tokens = render(RAGPrompt(chunks=CHUNKS, question=question), tok)
        sel = _selection(tokens, 0.15)
        always = (~sel.reusable).nonzero().flatten()
        rows = always[question_rows(sel, always)]
        last = tokens.chunk_segments()[-1]
        assert rows.tolist() == list(range(last.end, len(tokens)))
        text = tok.decode([tokens.token_ids[i] for i in rows])
        assert question in text and not any(c[-20:] in text for c in CHUNKS)
        last_three = _selection(tokens, 0.15, qattn_rows=3)
        assert always[question_rows(last_three, always)].tolist() == rows[-3:].tolist()


def test_question_attention_needs_chunks(two_tokenizers):
    from speccache_rag.selection.qattn import question_rows

    tokens = render(RAGPrompt(question="What?"), two_tokenizers[0])
    sel = _selection(tokens, 0.15)
    with pytest.raises(ValueError, match="needs a prompt with chunks"):
        question_rows(sel, torch.arange(len(tokens)))


def test_question_attention_probe_scores_what_the_rows_attend():
    from speccache_rag.selection.qattn import QuestionAttention, pool, scored_layers

    assert list(scored_layers(24, (0.5, 1.0))) == list(range(12, 24))
    assert list(scored_layers(24, (0.99, 1.0))) == [23]
    k = torch.zeros(1, 6, 4)
    k[0, 2] = 5.0                                           # key 2 matches the query strongly
    q = torch.ones(2, 3, 4)                                 # 2 heads (GQA over 1 KV head), 3 recomputed tokens
    probe = QuestionAttention(rows=torch.tensor([2]), row_pos=torch.tensor([5]), layers=range(1), scale=1.0,
                              num_keys=6)
    probe(0, q, k)
    probe(1, q, k)                                          # a layer not scored: ignored
    assert int(probe.scores.argmax()) == 2 and probe.scores.sum() == pytest.approx(1.0)
    early = QuestionAttention(rows=torch.tensor([0]), row_pos=torch.tensor([1]), layers=range(1), scale=1.0,
                              num_keys=6)
    early(0, q, k)                                          # causal: a row at position 1 sees keys 0..1 only
    assert early.scores[2:].sum() == 0 and early.scores[:2].sum() == pytest.approx(1.0)
    assert pool(torch.tensor([0.0, 1.0, 0.0, 0.0]), 3).tolist() == [1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("bad, match", [(dict(qattn_layers=(0.6, 0.5)), "qattn_layers"),
                                        (dict(qattn_layers=(0.0, 1.5)), "qattn_layers"),
                                        (dict(qattn_pool=0), "qattn_pool"), (dict(qattn_heads="sum"), "qattn_heads"),
                                        (dict(qattn_rows=-1), "qattn_rows")])
def test_bad_question_attention_options_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        ReuseConfig(method="qattn", **bad)


def test_each_qattn_round_recomputes_its_own_tokens_and_the_question(monkeypatch):
    """Rounds split the budget: every chunk token goes through the model at most once, the question once more
    per round (re-scored over what the round repaired), and the budget is spent exactly."""
    from speccache_rag.blend import Blender
    from speccache_rag.layers import HFLayers
    from speccache_rag.output import GenerationStats
    from speccache_rag.runner import KVCache
    from speccache_rag.selection import qattn
    from speccache_rag.store.memory import MemoryStore
    from tiny_models import tiny_random_model

    tok = load_tokenizer("smollm2-135m")
    model, _ = tiny_random_model("llama", tokenizer=tok)
    tokens = render(RAGPrompt(chunks=CHUNKS, question="How heavy is it?"), tok)
    blender = Blender(HFLayers(model), MemoryStore(), "tiny", [], sink="none")
    for seg in tokens.chunk_segments():
        blender.ensure_stored(tokens.token_ids[seg.start:seg.end], seg.text)
    passes = []

    def counted(run):
        def pass_(ops, cache, x, positions, **kw):
            passes.append(positions)
            return run(ops, cache, x, positions, **kw)
        return pass_

    monkeypatch.setattr(qattn, "prefill", counted(qattn.prefill))        # the first pass runs its layers itself
    monkeypatch.setattr(qattn, "run_layers", counted(qattn.run_layers))
    stats = GenerationStats("qattn", len(tokens))
    config = ReuseConfig(recompute_ratio=0.3, qattn_rounds=3)
    blender.blend(tokens, KVCache.empty(blender.ops, len(tokens)), config, stats)
    chunk_tokens = torch.cat([torch.arange(s.start, s.end) for s in tokens.chunk_segments()])
    in_chunks = [p[torch.isin(p, chunk_tokens)] for p in passes]
    question = torch.arange(tokens.chunk_segments()[-1].end, len(tokens))
    assert len(passes) == 4 and in_chunks[0].numel() == 0
    assert all(torch.isin(question, p).all() for p in passes)
    spent = torch.cat(in_chunks)
    assert spent.numel() == spent.unique().numel() == budget_for(0.3, chunk_tokens.numel())
    assert all(p.numel() > 0 for p in in_chunks[1:])


def test_every_configurable_method_has_one_registered_selector():
    from speccache_rag.config import METHODS

    assert set(SELECTORS) == set(METHODS) - {"full"}


def test_a_selector_under_an_undeclared_name_is_refused():
    from speccache_rag.selection import position_selector

    with pytest.raises(ValueError, match="METHOD_TRAITS"):
        position_selector("magic")(lambda sel, ops=None: sel.reusable_positions[:0])
    assert "magic" not in SELECTORS


def test_segments_from_spans_and_retokenize_keep_chunk_text_and_offsets():
    """A prompt known only as token ids and chunk spans (vllm serve) rebuilds the rendered segments."""
    tok = load_tokenizer("smollm2-135m")
    rendered = render(RAGPrompt(chunks=CHUNKS[:2], question="How heavy is it?"), tok)
    rebuilt = segments_from_spans(tok, rendered.token_ids, [(s.start, s.end) for s in rendered.chunk_segments()])
    assert rebuilt.token_ids == rendered.token_ids
    for got, want in zip(rebuilt.chunk_segments(), rendered.chunk_segments()):
        assert (got.start, got.end, got.text, got.offsets) == (want.start, want.end, want.text, want.offsets)
    view = retokenize(rebuilt, tok)                                  # same tokenizer: same tokens
    assert view.token_ids == rendered.token_ids
    assert [s.chunk for s in view.segments] == [s.chunk for s in rendered.segments]


def test_draft_selection_without_the_rag_prompt_equals_the_selection_with_it():
    """Without a RAGPrompt the draft reads the target's segments retokenized: with a shared tokenizer that
    is the very prompt, so the selection is the same."""
    from speccache_rag.layers import HFLayers
    from tiny_models import tiny_random_model

    tok = load_tokenizer("smollm2-135m")
    draft, _ = tiny_random_model("llama", tokenizer=tok)
    prompt = RAGPrompt(chunks=CHUNKS[:2], question="How heavy is it?")
    tokens = render(prompt, tok)
    reusable = torch.zeros(len(tokens), dtype=torch.bool)
    for seg in tokens.chunk_segments():
        reusable[seg.start:seg.end] = True
    reuse = ReuseConfig(method="speccache", recompute_ratio=0.15)
    budget = budget_for(0.15, int(reusable.sum()))
    rebuilt = segments_from_spans(tok, tokens.token_ids, [(s.start, s.end) for s in tokens.chunk_segments()])
    with_prompt = Selection(tokens, reusable, budget, reuse, prompt=prompt, draft=HFLayers(draft), draft_tokenizer=tok)
    without = Selection(rebuilt, reusable, budget, reuse, draft=HFLayers(draft), draft_tokenizer=tok)
    got = norm_select(without)
    assert got.tolist() == norm_select(with_prompt).tolist()
    assert len(got) == budget


def test_an_empty_chunk_span_is_neither_a_hit_nor_a_miss():
    """vllm serve passes chunk spans as given; an empty one must not reach the store or a zero-token prefill
    (which has no sink to stand on under ``sink="none"``)."""
    from speccache_rag.blend import Blender
    from speccache_rag.layers import HFLayers
    from speccache_rag.runner import KVCache
    from speccache_rag.output import GenerationStats
    from speccache_rag.store.memory import MemoryStore
    from tiny_models import tiny_random_model

    tok = load_tokenizer("smollm2-135m")
    model, _ = tiny_random_model("llama", tokenizer=tok)
    ops = HFLayers(model)
    rendered = render(RAGPrompt(chunks=CHUNKS[:2], question="How heavy is it?"), tok)
    first, second = rendered.chunk_segments()
    tokens = segments_from_spans(tok, rendered.token_ids, [(first.start, first.end), (first.end, first.end),
                                                           (second.start, second.end)])
    blender = Blender(ops, MemoryStore(), "tiny", [], sink="none")
    for _ in range(2):                                   # a cold store, then the chunks it stored
        stats = GenerationStats("qattn", len(tokens))
        blended = blender.blend(tokens, KVCache.empty(ops, len(tokens)), ReuseConfig(), stats)
        blender.store_missed(tokens, blended.missed, stats)
    assert (stats.cache_hits, stats.cache_misses) == (2, 0)
