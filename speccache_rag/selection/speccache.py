"""Draft question attention (SpecPC-style): the draft reads the whole prompt, its question rows score the chunks.

The draft sees across chunks, as the target would in a full prefill. In its deeper layers (the same
``qattn_layers`` span as the target's qattn), the rows after the last chunk — the question and the
template suffix — attend over the prompt; their attention (float32, those rows only) scores every
draft token. Then the paper's steps 2 and 3: spans, budget, character map to the target's tokens.
This is ``speccache``; the paper's deep-layer norm scorer is ``norm`` (``norm.py``); both share ``draft_spans.py``.
"""
from __future__ import annotations

import torch

from ..prompt import TokenizedPrompt
from ..runner import full_prefill
from .base import Selection
from .qattn import QuestionAttention, pool, question_start, scored_layers
from .registry import position_selector
from .draft_spans import select_by_draft


def draft_question_rows(draft_tokens: TokenizedPrompt, device: torch.device | str = "cpu") -> torch.Tensor:
    """Draft positions after the last chunk (question and template suffix): the target's rule, on the draft's tokens."""
    return torch.arange(question_start(draft_tokens), len(draft_tokens), device=device)


@torch.inference_mode()
def draft_attention_scores(draft, draft_tokens: TokenizedPrompt, sel: Selection) -> torch.Tensor:
    """Attention the question rows pay every draft position, in the scored layers, pooled → [Nd]."""
    cfg = sel.config
    rows = draft_question_rows(draft_tokens, draft.device)
    layers = scored_layers(draft.num_layers, cfg.qattn_layers)
    probe = QuestionAttention(rows, rows, layers, draft.scaling, len(draft_tokens), cfg.qattn_heads)
    full_prefill(draft, draft_tokens.ids, observe=probe)
    return pool(probe.scores, cfg.qattn_pool)


@position_selector("speccache")
def draft_attention_select(sel: Selection, ops=None) -> torch.Tensor:
    return select_by_draft(sel, lambda draft_tokens: draft_attention_scores(sel.draft, draft_tokens, sel))
