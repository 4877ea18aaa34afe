"""The paper's selection (method ``norm``): score with the draft's deep-layer residual norms, then the shared
steps 2 and 3 (``draft_spans.py``: spans, budget, mapping to the target's tokens)."""
from __future__ import annotations

import torch

from ..prompt import TokenizedPrompt
from .base import Selection, deep_layer_norms, hidden_states
from .draft_spans import select_by_draft
from .registry import position_selector


def score(draft, draft_tokens: TokenizedPrompt, fraction: float, states=hidden_states) -> torch.Tensor:
    """Step 1: importance of every draft token = mean deep-layer residual norm (pre-final-norm) → [Nd]."""
    capture = states(draft, draft_tokens.ids)
    return deep_layer_norms(capture, draft.num_layers, fraction).float()


@position_selector("norm")
def norm_select(sel: Selection, ops=None) -> torch.Tensor:
    """The paper's method: the draft reads the whole prompt; its deep-layer norms choose the tokens."""
    return select_by_draft(sel, lambda draft_tokens: score(sel.draft, draft_tokens, sel.config.draft_layers,
                                                           sel.hidden_states))
