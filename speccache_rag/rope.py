"""Rotate cached (pre-RoPE) keys to their true positions with the model's own rotary embedding.

Going through ``model.model.rotary_emb`` rather than re-deriving frequencies keeps every rope
variant the checkpoint declares (llama3, yarn, dynamic, linear scaling) exactly as the model uses it.
"""
from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def cos_sin(model, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [S] → cos, sin: [S, head_dim] in ``like``'s dtype."""
    cos, sin = model.model.rotary_emb(like, positions[None])
    return cos[0], sin[0]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., S, head_dim]; cos, sin: [S, head_dim]."""
    return x * cos + rotate_half(x) * sin


def rotate_keys(model, k_pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """k_pre: [..., S, head_dim] keys before RoPE → keys as the model would hold them at ``positions`` [S]."""
    cos, sin = cos_sin(model, positions, k_pre)
    return apply_rope(k_pre, cos, sin)
