"""Selections that ignore the prompt's content: EPIC's leading tokens and a random lower bound."""
from __future__ import annotations

import torch

from .base import Selection
from .registry import position_selector


@position_selector("reuse")
def reuse_select(sel: Selection, ops=None) -> torch.Tensor:
    """Nothing: only the tokens without cached KV are computed (Prompt-Cache-style concatenation)."""
    return sel.reusable_positions[:0]


@position_selector("epic")
def epic_select(sel: Selection, ops=None) -> torch.Tensor:
    """The first k tokens of every reused chunk (EPIC / LegoLink); unset, k is the largest that fits the budget."""
    reused = sel.reused_chunks()
    chunks = [torch.arange(s.start, s.end, device=sel.device) for s in sel.tokens.chunk_segments() if s.chunk in reused]
    k = sel.config.epic_k
    if k is None:
        k = 0
        longest = max((len(c) for c in chunks), default=0)
        while k < longest and sum(min(k + 1, len(c)) for c in chunks) <= sel.budget:
            k += 1
    picked = [c[:k] for c in chunks]
    return torch.cat(picked) if picked else torch.empty(0, dtype=torch.long, device=sel.device)


@position_selector("random")
def random_select(sel: Selection, ops=None) -> torch.Tensor:
    cand = sel.reusable_positions
    gen = torch.Generator(device="cpu").manual_seed(sel.config.seed)    # the same draw on every device
    order = torch.randperm(cand.numel(), generator=gen, device="cpu").to(cand.device)
    return cand[order[: sel.budget]].sort().values
