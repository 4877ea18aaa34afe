"""SpecCache selection: the paper's three steps — score with the draft, expand to spans, map to the target.

The draft reads the prompt through its own chat template and tokenizer; tokens meet the target's
by character offsets inside the chunk text they both contain, so any tokenizer pair works.
"""
from __future__ import annotations

import torch

from ..prompt import RAGPrompt, TokenizedPrompt, render
from ..runner import full_prefill
from .base import Selection, budget_for, deep_layer_norms


def score(draft, draft_tokens: TokenizedPrompt, fraction: float) -> torch.Tensor:
    """Step 1: importance of every draft token = mean deep-layer residual norm (pre-final-norm) → [Nd]."""
    capture: dict[int, torch.Tensor] = {}
    full_prefill(draft, draft_tokens.ids, capture=capture)
    return deep_layer_norms(capture, draft.config.num_hidden_layers, fraction)


def smooth_spans(scores: torch.Tensor, start: int, end: int, tau_smooth: float, max_span: int) -> list[range]:
    """Cut [start, end) where the score jumps by more than tau_smooth (relative) or a span hits max_span."""
    spans, begin = [], start
    for i in range(start + 1, end):
        prev = float(scores[i - 1])
        jump = abs(float(scores[i]) - prev) / max(abs(prev), 1e-6)
        if jump > tau_smooth or i - begin >= max_span:
            spans.append(range(begin, i))
            begin = i
    if begin < end:
        spans.append(range(begin, end))
    return spans


def expand(scores: torch.Tensor, candidates: torch.Tensor, spans: list[range], k: int, tau_cover: float) -> list[int]:
    """Step 2: priority order of draft tokens — the top k, then the rest of every span already
    ≥ tau_cover selected (best spans first), then the remaining candidates by score."""
    order = candidates[scores[candidates].argsort(descending=True)].tolist()
    top = set(order[:k])
    completions = []
    for span in spans:
        covered = sum(i in top for i in span)
        if covered < len(span) and covered >= tau_cover * len(span):
            completions.append((float(scores[list(span)].mean()), [i for i in span if i not in top]))
    completions.sort(key=lambda c: -c[0])
    added = [i for _, rest in completions for i in rest]
    seen = top | set(added)
    return order[:k] + added + [i for i in order[k:] if i not in seen]


def map_to_target(draft_tokens: TokenizedPrompt, target_tokens: TokenizedPrompt) -> dict[int, list[int]]:
    """Step 3: draft position → target positions whose characters overlap it, chunk by chunk."""
    target_chunks = {s.chunk: s for s in target_tokens.chunk_segments()}
    mapping: dict[int, list[int]] = {}
    for ds in draft_tokens.chunk_segments():
        ts = target_chunks[ds.chunk]
        owner = [-1] * (len(ts.text) + 1)                                    # char → target position
        for j, (a, b) in enumerate(ts.offsets):
            for ch in range(a, b):
                owner[ch] = ts.start + j
        for j, (a, b) in enumerate(ds.offsets):
            hits = {owner[ch] for ch in range(a, b)} - {-1}
            mapping[ds.start + j] = sorted(hits)
    return mapping


def speculative_select(sel: Selection, prompt: RAGPrompt, draft, draft_tokenizer) -> torch.Tensor:
    draft_tokens = render(prompt, draft_tokenizer)
    return select_by_draft_scores(sel, draft_tokens, score(draft, draft_tokens, sel.config.draft_layers))


def select_by_draft_scores(sel: Selection, draft_tokens: TokenizedPrompt, scores: torch.Tensor) -> torch.Tensor:
    """Steps 2 and 3 for any per-draft-token scores [Nd] → target positions within ``sel.budget``."""
    cfg = sel.config
    # Only draft tokens of chunks whose KV the target reuses compete for the budget.
    reused = {t.chunk for t in sel.tokens.chunk_segments() if sel.reusable[t.start]}
    segs = [s for s in draft_tokens.chunk_segments() if s.chunk in reused]
    if not segs or sel.budget == 0:
        return torch.empty(0, dtype=torch.long)
    candidates = torch.cat([torch.arange(s.start, s.end) for s in segs])
    spans = []
    if cfg.span_rule == "smooth":
        for s in segs:
            spans += smooth_spans(scores, s.start, s.end, cfg.tau_smooth, cfg.max_span)
    priority = expand(scores, candidates, spans, budget_for(cfg.recompute_ratio, candidates.numel()), cfg.tau_cover)
    mapping = map_to_target(draft_tokens, sel.tokens)
    chosen: dict[int, None] = {}                                             # ordered set
    for d in priority:
        for t in mapping[d]:
            if len(chosen) < sel.budget and sel.reusable[t]:
                chosen[t] = None
        if len(chosen) >= sel.budget:
            break
    # Target tokens no draft token overlaps (rare: offset gaps) still count toward a full budget.
    for t in sel.reusable_positions.tolist():
        if len(chosen) >= sel.budget:
            break
        chosen.setdefault(t, None)
    return torch.tensor(sorted(chosen), dtype=torch.long)
