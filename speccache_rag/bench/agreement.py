"""The paper's evidence, measured: do the draft's deep-layer norms pick the same tokens as the target's?

For one prompt: the top 20 % of the chunk tokens by
  - the target's deep-layer norm (mean over its last third of layers; the reference),
  - the draft's deep-layer norm, mapped onto target tokens (max over overlapping draft tokens),
  - the target's layer-0 output norm (what the paper says is a worse proxy),
and their Jaccard overlaps. Two equal-size random sets of a fraction p overlap by p / (2 − p)
(0.111 at p = 0.2): that is the no-signal line.
"""
from __future__ import annotations

from collections import Counter

import torch

from ..prompt import TokenizedPrompt
from ..selection.base import deep_layer_norms
from ..selection.draft_spans import map_to_target
from .metrics import jaccard


def _top(scores: torch.Tensor, candidates: torch.Tensor, fraction: float) -> set[int]:
    k = max(1, round(fraction * candidates.numel()))
    return set(candidates[scores[candidates].topk(k).indices].tolist())


def draft_scores_on_target(draft_scores: torch.Tensor, draft_tokens: TokenizedPrompt,
                           target_tokens: TokenizedPrompt) -> torch.Tensor:
    """Draft token scores carried to target positions by character overlap (max); 0 where none overlap."""
    pd, pt = map_to_target(draft_tokens, target_tokens)
    return torch.zeros(len(target_tokens)).scatter_reduce(0, pt, draft_scores[pd].float(), "amax")


def agreement(target_capture: dict[int, torch.Tensor], target_layers: int, target_tokens: TokenizedPrompt,
              draft_capture: dict[int, torch.Tensor], draft_layers: int, draft_tokens: TokenizedPrompt,
              tokenizer=None, fraction: float = 0.2, deep_fraction: float = 1 / 3) -> dict:
    cand = torch.cat([torch.arange(s.start, s.end) for s in target_tokens.chunk_segments()])
    t_deep = deep_layer_norms(target_capture, target_layers, deep_fraction)
    t_l0 = target_capture[0].float().norm(dim=-1)
    d_deep = draft_scores_on_target(deep_layer_norms(draft_capture, draft_layers, deep_fraction),
                                    draft_tokens, target_tokens)
    ref = _top(t_deep, cand, fraction)
    gen = torch.Generator().manual_seed(0)
    rand = set(cand[torch.randperm(cand.numel(), generator=gen)[: len(ref)]].tolist())
    norms = t_deep[cand]
    med = float(norms.median())
    row = {
        "jaccard_draft_vs_target_deep": jaccard(_top(d_deep, cand, fraction), ref),
        "jaccard_target_l0_vs_deep": jaccard(_top(t_l0, cand, fraction), ref),
        "jaccard_random_vs_target_deep": jaccard(rand, ref),
        "jaccard_expected_random": fraction / (2 - fraction),
        # shape of the raw score the paper selects by, on chunk tokens
        "target_deep_norm_p90_over_p10": float(norms.quantile(0.9) / norms.quantile(0.1)),
        "target_deep_norm_max_over_median": float(norms.max() / med),
        "prompt_first_token_over_median": float(t_deep[0] / med),
        "top_chunk_initial_share": sum(
            1 for s in target_tokens.chunk_segments() for p in range(s.start, min(s.end, s.start + 4)) if p in ref
        ) / len(ref),
    }
    if tokenizer is not None:
        counts = Counter(tokenizer.decode([target_tokens.token_ids[p]]).strip() or repr(
            tokenizer.decode([target_tokens.token_ids[p]])) for p in ref)
        row["top_tokens"] = counts.most_common(12)
    return row
