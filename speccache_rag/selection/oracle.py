"""Upper bound for norm-based selection: the target's own deep-layer norms from a full prefill."""
from __future__ import annotations

import torch

from .base import Selection, deep_layer_norms, top_positions
from .registry import position_selector


@position_selector("oracle")
def oracle_select(sel: Selection, ops) -> torch.Tensor:
    capture = sel.hidden_states(ops, sel.tokens.ids)
    scores = deep_layer_norms(capture, ops.num_layers, sel.config.draft_layers)
    return top_positions(scores, sel.reusable_positions, sel.budget)
