"""Steps 2 and 3 of the paper's selection, shared by every draft scorer (``norm``, ``speccache``, ``deviation``):
widen the draft's top tokens to spans, spend the budget, map draft tokens to the target's.

The draft reads the prompt through its own chat template and tokenizer; tokens meet the target's
by character offsets inside the chunk text they both contain, so any tokenizer pair works. Both steps
are tensor operations over all chunk tokens at once: at a few thousand tokens they cost milliseconds,
next to the draft's forward pass.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..prompt import TokenizedPrompt
from .base import Selection, adaptive_budget, budget_for

HOST = "cpu"        # where the draft→target mapping runs: small index arithmetic, whatever the models' devices


def span_ids(scores: torch.Tensor, candidates: torch.Tensor, chunk_start: torch.Tensor, tau_smooth: float,
             max_span: int) -> torch.Tensor:
    """Label each candidate with its span: a span is cut at every chunk start, wherever the score jumps by
    more than ``tau_smooth`` relative to the previous token, and every ``max_span`` tokens.

    scores: [Nd]; candidates: draft positions [C] (chunks in order); chunk_start: bool [C] → span id [C].
    """
    s = scores[candidates]
    prev = scores[(candidates - 1).clamp_min(0)]
    cut = chunk_start | ((s - prev).abs() / prev.abs().clamp_min(1e-6) > tau_smooth)
    idx = torch.arange(candidates.numel(), device=HOST)
    first = idx[cut]                                                          # start of each smooth run
    offset = idx - first[cut.long().cumsum(0) - 1]                            # index within its run
    return (cut | (offset % max_span == 0)).long().cumsum(0) - 1


def expand(scores: torch.Tensor, spans: torch.Tensor | None, k: int, tau_cover: float) -> torch.Tensor:
    """Step 2: priority order (indices into the candidates) — the top k, then the rest of every span already
    ≥ tau_cover selected (best span mean first), then the remaining candidates by score.

    scores: [C] candidate scores; spans: span id [C] or None (no span completion)."""
    order = scores.argsort(descending=True, stable=True)
    if spans is None:
        return order
    top = torch.zeros_like(scores, dtype=torch.bool)
    top[order[:k]] = True
    length = torch.bincount(spans).float()
    covered = torch.bincount(spans, weights=top.float(), minlength=length.numel())
    mean = torch.bincount(spans, weights=scores.float(), minlength=length.numel()) / length
    complete = (covered < length) & (covered >= tau_cover * length)
    add = complete[spans] & ~top
    added = add.nonzero().flatten()
    added = added[(-mean[spans[added]]).argsort(stable=True)]                # best spans first, in position order
    rest = order[k:]
    return torch.cat([order[:k], added, rest[~add[rest]]])


def _offsets(seg) -> torch.Tensor:
    return torch.tensor(seg.offsets, dtype=torch.long, device=HOST).reshape(-1, 2)


def map_to_target(draft_tokens: TokenizedPrompt, target_tokens: TokenizedPrompt) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: every (draft position, target position) pair whose characters overlap, chunk by chunk.

    → (draft positions [P], target positions [P]), grouped by draft position in increasing order."""
    target_chunks = {s.chunk: s for s in target_tokens.chunk_segments()}
    pairs_d, pairs_t = [], []
    for ds in draft_tokens.chunk_segments():
        ts = target_chunks[ds.chunk]
        d, t = _offsets(ds), _offsets(ts)                                     # [Dn, 2], [Tn, 2] char spans
        # Target spans are in text order, so the ones overlapping [a, b) form a run: from the first whose
        # end passes a to the last whose start precedes b. The exact overlap test below drops any stray.
        lo = torch.searchsorted(t[:, 1].cummax(0).values.contiguous(), d[:, 0].contiguous(), right=True)
        hi = torch.searchsorted(t[:, 0].cummax(0).values.contiguous(), d[:, 1].contiguous(), right=False)
        count = (hi - lo).clamp_min(0) * (d[:, 0] < d[:, 1])
        dj = torch.repeat_interleave(torch.arange(d.shape[0], device=HOST), count)
        starts = torch.repeat_interleave(lo, count)
        tj = starts + torch.arange(dj.numel(), device=HOST) - torch.repeat_interleave(count.cumsum(0) - count, count)
        ok = (t[tj, 0] < d[dj, 1]) & (d[dj, 0] < t[tj, 1]) & (t[tj, 0] < t[tj, 1])
        pairs_d.append(dj[ok] + ds.start)
        pairs_t.append(tj[ok] + ts.start)
    if not pairs_d:
        return torch.empty(0, dtype=torch.long, device=HOST), torch.empty(0, dtype=torch.long, device=HOST)
    return torch.cat(pairs_d), torch.cat(pairs_t)


def select_by_draft(sel: Selection, scorer: Callable[[TokenizedPrompt], torch.Tensor]) -> torch.Tensor:
    """Every draft scorer's selection: ``scorer(draft_tokens) -> [Nd]`` (timed as the draft's forward), then
    steps 2 and 3."""
    draft_tokens = sel.draft_tokens()
    t = time.perf_counter()
    scores = scorer(draft_tokens)
    sel.timings["draft_forward_s"] = time.perf_counter() - t
    return select_by_draft_scores(sel, draft_tokens, scores)


def select_by_draft_scores(sel: Selection, draft_tokens: TokenizedPrompt, scores: torch.Tensor) -> torch.Tensor:
    """Steps 2 and 3 for any per-draft-token scores [Nd] → target positions within ``sel.budget``."""
    cfg = sel.config
    # Only draft tokens of chunks whose KV the target reuses compete for the budget.
    reused = sel.reused_chunks()
    segs = [s for s in draft_tokens.chunk_segments() if s.chunk in reused and s.end > s.start]
    if not segs or sel.budget == 0:
        return torch.empty(0, dtype=torch.long, device=sel.device)
    # index bookkeeping on the host: the draft's scores may come from another device than the target's
    scores, reusable = scores.to(HOST), sel.reusable.to(HOST)
    candidates = torch.cat([torch.arange(s.start, s.end, device=HOST) for s in segs])   # [C] draft positions
    chunk_start = torch.zeros(candidates.numel(), dtype=torch.bool, device=HOST)
    chunk_start[torch.tensor([0] + [s.end - s.start for s in segs[:-1]], device=HOST).cumsum(0)] = True
    spans = (span_ids(scores, candidates, chunk_start, cfg.tau_smooth, cfg.max_span)
             if cfg.span_rule == "smooth" else None)
    k = adaptive_budget(scores[candidates], cfg)
    budget = sel.budget if cfg.recompute_ratio != "auto" else min(sel.budget, budget_for(
        k / candidates.numel(), int(reusable.sum())))
    priority = candidates[expand(scores[candidates], spans, k, cfg.tau_cover)]        # draft positions, best first

    # Walk the priority order through the draft→target pairs; a target position counts at its first pair.
    pd, pt = map_to_target(draft_tokens, sel.tokens)
    keep = reusable[pt]
    pd, pt = pd[keep], pt[keep]
    rank_of_draft = torch.full((len(draft_tokens),), priority.numel(), dtype=torch.long, device=HOST)
    rank_of_draft[priority] = torch.arange(priority.numel(), device=HOST)
    n = len(sel.tokens)
    first = torch.full((n,), priority.numel(), dtype=torch.long, device=HOST).scatter_reduce(0, pt, rank_of_draft[pd],
                                                                                          "amin")
    ranked = (first < priority.numel()).nonzero().flatten()
    chosen = ranked[first[ranked].argsort(stable=True)][:budget]
    if chosen.numel() < budget:
        # Target tokens no draft token overlaps (rare: offset gaps) still count toward a full budget.
        rest = reusable.clone()
        rest[chosen] = False
        chosen = torch.cat([chosen, rest.nonzero().flatten()[: budget - chosen.numel()]])
    return chosen.sort().values.to(sel.device)
