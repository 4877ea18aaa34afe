from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..config import ReuseConfig
from ..prompt import TokenizedPrompt


@dataclass
class Selection:
    """What a selector sees: the target's tokenized prompt, which positions hold reused KV, the budget."""

    tokens: TokenizedPrompt
    reusable: torch.Tensor          # bool [N]: KV loaded from the store
    budget: int                     # how many reusable positions may be recomputed
    config: ReuseConfig
    timings: dict[str, float] = field(default_factory=dict)   # filled by selectors, e.g. draft_forward_s

    @property
    def reusable_positions(self) -> torch.Tensor:
        return self.reusable.nonzero().flatten()


def budget_for(ratio: float, num_reusable: int) -> int:
    # The epsilon keeps 0.15 * 100 from rounding up to 16 through float error.
    return min(num_reusable, math.ceil(ratio * num_reusable - 1e-9))


def top_positions(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """scores: [N] over all positions; candidates: positions [C] → the k best candidates, sorted by position."""
    if k <= 0 or candidates.numel() == 0:
        return candidates[:0]
    best = scores[candidates].topk(min(k, candidates.numel())).indices
    return candidates[best].sort().values


def deep_layer_norms(capture: dict[int, torch.Tensor], num_layers: int, fraction: float) -> torch.Tensor:
    """Mean L2 norm of the residual stream over the last ``fraction`` of layers → [N]."""
    first = num_layers - max(1, round(num_layers * fraction))
    return torch.stack([capture[i].norm(dim=-1) for i in range(first, num_layers)]).mean(0)
