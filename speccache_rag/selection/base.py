"""What every selector sees (`Selection`), how budgets are sized (fixed or "auto"), and the shared scoring helpers."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import ReuseConfig
from ..prompt import RAGPrompt, TokenizedPrompt, render, retokenize
from ..runner import full_prefill


def hidden_states(ops, token_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Residual stream after every layer of a plain prefill: layer → [N, hidden]."""
    capture: dict[int, torch.Tensor] = {}
    full_prefill(ops, token_ids, capture=capture)
    return capture


@dataclass
class Selection:
    """What a selector sees: the target's tokenized prompt, which positions hold reused KV, the budget,
    and for draft-scored methods the prompt (None when only its tokens are known) and the draft."""

    tokens: TokenizedPrompt
    reusable: torch.Tensor          # bool [N]: KV loaded from the store
    budget: int                     # how many reusable positions may be recomputed
    config: ReuseConfig
    prompt: RAGPrompt | None = None
    draft: object = None            # LayerOps of the draft model
    draft_tokenizer: object = None
    # (LayerOps, token ids [N]) → {layer: residual [N, hidden]}; the bench swaps in a memoized one
    hidden_states: Callable[[object, torch.Tensor], dict[int, torch.Tensor]] = hidden_states
    timings: dict[str, float] = field(default_factory=dict)   # select_s, draft_forward_s
    sink: str = "bos"               # the chunk-KV policy the stored chunks were computed under

    def reused_chunks(self) -> set[int]:
        """Indices of the chunks whose KV came from the store."""
        return {s.chunk for s in self.tokens.chunk_segments() if s.end > s.start and self.reusable[s.start]}

    def draft_tokens(self) -> TokenizedPrompt:
        """The prompt as the draft reads it: through its own chat template when the RAGPrompt is known,
        else the target's segments retokenized (chunk boundaries line up either way)."""
        if self.prompt is not None:
            return render(self.prompt, self.draft_tokenizer)
        return retokenize(self.tokens, self.draft_tokenizer)

    @property
    def reusable_positions(self) -> torch.Tensor:
        return self.reusable.nonzero().flatten()

    @property
    def device(self) -> torch.device:
        """The target's device: where every position tensor of the selection lives."""
        return self.reusable.device


def budget_for(ratio: float | str, num_reusable: int, config: ReuseConfig | None = None) -> int:
    """How many of ``num_reusable`` tokens a ratio recomputes; for ``"auto"``, the upper bound of its range."""
    if ratio == "auto":
        ratio = (config or ReuseConfig()).auto_range[1]
    # The epsilon keeps 0.15 * 100 from rounding up to 16 through float error.
    return min(num_reusable, math.ceil(ratio * num_reusable - 1e-9))


def adaptive_budget(scores: torch.Tensor, config: ReuseConfig) -> int:
    """How many of the candidates scored ``scores`` [C] to recompute: the fixed ratio's share, or for
    ``recompute_ratio="auto"`` the fewest top-scored ones holding ``auto_mass`` of the (non-negative)
    score mass, within ``auto_range``."""
    n = scores.numel()
    if config.recompute_ratio != "auto":
        return budget_for(config.recompute_ratio, n)
    lo, hi = (budget_for(r, n) for r in config.auto_range)
    mass = scores.float().clamp_min(0).sort(descending=True).values.cumsum(0)
    if n == 0 or mass[-1] <= 0:
        return hi
    k = int((mass < config.auto_mass * mass[-1] * (1 - 1e-6)).sum()) + 1
    return max(lo, min(hi, k))


def top_positions(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """scores: [N] over all positions; candidates: positions [C] → the k best candidates, sorted by position."""
    if k <= 0 or candidates.numel() == 0:
        return candidates[:0]
    best = scores[candidates].topk(min(k, candidates.numel())).indices
    return candidates[best].sort().values


def deep_layers(num_layers: int, fraction: float) -> range:
    """The last ``fraction`` of the layers (at least one): where the draft scorers read the residual."""
    return range(num_layers - max(1, round(num_layers * fraction)), num_layers)


def deep_layer_norms(capture: dict[int, torch.Tensor], num_layers: int, fraction: float) -> torch.Tensor:
    """Mean L2 norm of the residual stream over the last ``fraction`` of layers → [N], float32 (bfloat16
    norms of similar tokens tie)."""
    return torch.stack([capture[i].float().norm(dim=-1) for i in deep_layers(num_layers, fraction)]).mean(0)
