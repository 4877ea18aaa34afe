"""Upper bound for norm-based selection: the target's own deep-layer norms from a full prefill."""
from __future__ import annotations

import torch

from ..runner import full_prefill
from .base import Selection, deep_layer_norms, top_positions


def oracle_select(sel: Selection, model) -> torch.Tensor:
    capture: dict[int, torch.Tensor] = {}
    full_prefill(model, sel.tokens.ids, capture=capture)
    scores = deep_layer_norms(capture, model.config.num_hidden_layers, sel.config.draft_layers)
    return top_positions(scores, sel.reusable_positions, sel.budget)
