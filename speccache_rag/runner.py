"""The one model runner: a layer-by-layer forward pass over HF llama/qwen2 modules.

Every way of filling a KV cache is the same loop over a set of token positions:
full prefill recomputes every position, blending recomputes a scattered subset against a cache
already holding the reused chunks, and decoding recomputes one new position. Each layer writes the
recomputed tokens' K/V into the cache *before* attending, and queries see keys causally by true
position, so "recompute everything" is a plain prefill.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .rope import apply_rope, cos_sin

SUPPORTED_ARCHS = ("llama", "qwen2")


@dataclass
class KVCache:
    """k, v: [layers, kv_heads, capacity, head_dim], keys after RoPE at their true positions.

    ``k_pre`` (same shape), when present, also receives keys *before* RoPE: that is what a chunk's
    stored KV holds, so it can be re-rotated to any position later.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_pre: torch.Tensor | None = None

    @classmethod
    def empty(cls, model, capacity: int, keep_pre_rope: bool = False) -> "KVCache":
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, capacity, head_dim)
        dtype = next(model.parameters()).dtype
        k = torch.zeros(shape, dtype=dtype)
        return cls(k=k, v=torch.zeros_like(k), k_pre=torch.zeros_like(k) if keep_pre_rope else None)


def check_arch(model) -> None:
    arch = model.config.model_type
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"architecture {arch!r} is not supported by the runner (supported: {', '.join(SUPPORTED_ARCHS)})")
    if getattr(model.config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported by the runner")


def embed(model, token_ids: torch.Tensor) -> torch.Tensor:
    """token_ids: [S] → residual stream h: [S, hidden]."""
    return model.model.embed_tokens(token_ids)


# observe(layer, q, k): q [H, S, D] the recomputed tokens' rotated queries, k [KVH, T, D] the cache's keys
Observer = Callable[[int, torch.Tensor, torch.Tensor], None]


def run_layers(model, cache: KVCache, h: torch.Tensor, positions: torch.Tensor, layers: range | None = None,
               capture: dict[int, torch.Tensor] | None = None, observe: Observer | None = None) -> torch.Tensor:
    """Advance the residual stream of the tokens at ``positions`` through ``layers``.

    h: [S, hidden], positions: [S] (sorted, distinct). Their K/V are written into ``cache`` at
    ``positions``; queries attend to cache entries [0, max(positions)] with key_pos <= query_pos.
    ``capture[i]`` receives the residual output of layer i (before any final norm); ``observe`` sees
    each layer's queries and keys (SDPA does not return attention weights).
    """
    m = model.model
    layers = range(len(m.layers)) if layers is None else layers
    num_keys = int(positions.max()) + 1
    # Sorted distinct positions that fill [0, T) are a plain prefill: the fused causal kernel is ~2x faster.
    dense = positions.numel() == num_keys
    mask = None if dense else torch.arange(num_keys)[None, :] <= positions[:, None]   # [S, T]
    cos, sin = cos_sin(model, positions, h)                                  # [S, D]
    S = h.shape[0]
    for i in layers:
        layer = m.layers[i]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(S, -1, attn.head_dim).transpose(0, 1)       # [H, S, D]
        k = attn.k_proj(x).view(S, -1, attn.head_dim).transpose(0, 1)       # [KVH, S, D]
        v = attn.v_proj(x).view(S, -1, attn.head_dim).transpose(0, 1)
        if cache.k_pre is not None:
            cache.k_pre[i][:, positions] = k
        cache.k[i][:, positions] = apply_rope(k, cos, sin)
        cache.v[i][:, positions] = v
        q = apply_rope(q, cos, sin)
        if observe is not None:
            observe(i, q, cache.k[i, :, :num_keys])
        o = F.scaled_dot_product_attention(
            q[None], cache.k[i, :, :num_keys][None], cache.v[i, :, :num_keys][None],
            attn_mask=mask, is_causal=dense, scale=attn.scaling, enable_gqa=True)[0]          # [H, S, D]
        h = h + attn.o_proj(o.transpose(0, 1).reshape(S, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if capture is not None:
            capture[i] = h
    return h


def logits(model, h_last: torch.Tensor) -> torch.Tensor:
    """h_last: [hidden] residual of the last token → next-token logits [vocab] (float32)."""
    return model.lm_head(model.model.norm(h_last)).float()


@torch.inference_mode()
def prefill(model, cache: KVCache, token_ids: torch.Tensor, positions: torch.Tensor,
            capture: dict[int, torch.Tensor] | None = None, observe: Observer | None = None) -> torch.Tensor:
    """Recompute ``token_ids`` at ``positions`` through every layer; returns the last one's logits."""
    h = run_layers(model, cache, embed(model, token_ids), positions, capture=capture, observe=observe)
    return logits(model, h[-1])


def full_prefill(model, token_ids: torch.Tensor, capacity: int | None = None, keep_pre_rope: bool = False,
                 capture: dict[int, torch.Tensor] | None = None) -> tuple[KVCache, torch.Tensor]:
    """Plain prefill of token_ids [N] at positions 0..N-1 → (cache, last-token logits)."""
    n = token_ids.shape[0]
    cache = KVCache.empty(model, capacity or n, keep_pre_rope=keep_pre_rope)
    return cache, prefill(model, cache, token_ids, torch.arange(n), capture=capture)


def decode_one(model, cache: KVCache, token_id: int, position: int) -> torch.Tensor:
    """Append one token at ``position`` → logits for the next one."""
    return prefill(model, cache, torch.tensor([token_id]), torch.tensor([position]))
