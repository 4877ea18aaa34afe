"""The one model runner: a layer-by-layer forward pass over any :class:`~speccache_rag.layers.LayerOps`.

Every way of filling a KV cache is the same loop over a set of token positions:
full prefill recomputes every position, blending recomputes a scattered subset against a cache
already holding the reused chunks, and decoding recomputes one new position. Each layer writes the
recomputed tokens' K/V into the cache *before* attending, and queries see keys causally by true
position, so "recompute everything" is a plain prefill. Both engines run this loop: the torch engine
over HF modules, the vLLM connector over vLLM's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .layers import LayerOps


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
    def empty(cls, ops: LayerOps, capacity: int, keep_pre_rope: bool = False) -> "KVCache":
        k = torch.zeros((ops.num_layers, ops.num_kv_heads, capacity, ops.head_dim), dtype=ops.dtype, device=ops.device)
        return cls(k=k, v=torch.zeros_like(k), k_pre=torch.zeros_like(k) if keep_pre_rope else None)

    def write(self, layer: int, positions: torch.Tensor, k_pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.k_pre is not None:
            self.k_pre[layer][:, positions] = k_pre
        self.k[layer][:, positions] = k
        self.v[layer][:, positions] = v

    def read(self, layer: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of positions [0, num_keys) that the layer attends to."""
        return self.k[layer, :, :num_keys], self.v[layer, :, :num_keys]


class LayerCache(Protocol):
    """What the layer loop needs of a cache: :class:`KVCache`, or the offloaded decode's mixed-precision view."""

    def write(self, layer: int, positions: torch.Tensor, k_pre: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None: ...

    def read(self, layer: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]: ...


# observe(layer, q, k): q [H, S, D] the recomputed tokens' rotated queries, k [KVH, T, D] the cache's keys
Observer = Callable[[int, torch.Tensor, torch.Tensor], None]


def attention_mask(positions: torch.Tensor, num_keys: int, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[S, T], added to the attention logits: 0 for the keys each query sees — earlier true positions, within
    ``window`` of it where the layer has one — and -inf for the rest (SDPA would turn a boolean mask into this
    on every call). None for a plain prefill no window narrows: sorted distinct positions filling [0, T) take
    the fused causal kernel, ~2x faster."""
    if positions.numel() == num_keys and (window is None or window >= num_keys):
        return None
    keys = torch.arange(num_keys, device=positions.device)[None, :]
    seen = keys <= positions[:, None]
    if window is not None:
        seen &= keys > positions[:, None] - window
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))


def run_layers(ops: LayerOps, cache: LayerCache, h: torch.Tensor, positions: torch.Tensor, layers: range | None = None,
               capture: dict[int, torch.Tensor] | None = None, observe: Observer | None = None) -> torch.Tensor:
    """Advance the residual stream of the tokens at ``positions`` through ``layers``.

    h: [S, hidden], positions: [S] (sorted, distinct). Their K/V are written into ``cache`` at
    ``positions``; queries attend to cache entries [0, max(positions)] with key_pos <= query_pos.
    ``capture[i]`` receives the residual output of layer i (before any final norm); ``observe`` sees
    each layer's queries and keys (SDPA does not return attention weights).
    """
    layers = range(ops.num_layers) if layers is None else layers
    positions = positions.to(ops.device)        # host-side bookkeeping may hand them in from the CPU
    num_keys = int(positions.max()) + 1
    masks: dict[int | None, torch.Tensor | None] = {}
    rope = ops.rope(positions, h)
    S = h.shape[0]
    for i in layers:
        q, k_pre, k, v = ops.attention_inputs(i, h, rope)
        cache.write(i, positions, k_pre, k, v)
        keys, values = cache.read(i, num_keys)
        if observe is not None:
            observe(i, q, keys)
        window = ops.windows[i]
        if window not in masks:
            masks[window] = attention_mask(positions, num_keys, window, q.dtype)
        o = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=masks[window],
                                           is_causal=masks[window] is None, scale=ops.scaling,
                                           enable_gqa=True)[0]                                       # [H, S, D]
        h = ops.attention_output(i, h, o.transpose(0, 1).reshape(S, -1))
        if capture is not None:
            capture[i] = h
    return h


@torch.inference_mode()
def prefill(ops: LayerOps, cache: KVCache, token_ids: torch.Tensor, positions: torch.Tensor,
            capture: dict[int, torch.Tensor] | None = None, observe: Observer | None = None) -> torch.Tensor | None:
    """Recompute ``token_ids`` at ``positions`` through every layer; returns the last one's logits."""
    h = run_layers(ops, cache, ops.embed(token_ids.to(ops.device)), positions, capture=capture, observe=observe)
    return ops.logits(h[-1])


def full_prefill(ops: LayerOps, token_ids: torch.Tensor, capacity: int | None = None, keep_pre_rope: bool = False,
                 capture: dict[int, torch.Tensor] | None = None,
                 observe: Observer | None = None) -> tuple[KVCache, torch.Tensor | None]:
    """Plain prefill of token_ids [N] at positions 0..N-1 → (cache, last-token logits)."""
    n = token_ids.shape[0]
    cache = KVCache.empty(ops, capacity or n, keep_pre_rope=keep_pre_rope)
    return cache, prefill(ops, cache, token_ids, torch.arange(n, device=ops.device), capture=capture, observe=observe)


def decode_one(ops: LayerOps, cache: KVCache, token_id: int, position: int) -> torch.Tensor:
    """Append one token at ``position`` → logits for the next one."""
    return prefill(ops, cache, torch.tensor([token_id], device=ops.device), torch.tensor([position], device=ops.device))
