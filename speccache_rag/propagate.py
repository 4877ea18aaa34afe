"""Stale chunk tokens borrow the KV correction of the recomputed tokens around them (issue 24).

A reused chunk token that is not recomputed keeps the keys and values it got without the rest of the prompt.
The recomputed tokens show, layer by layer, how far the missing context moves them, and on real passages a
token's move resembles those of the recomputed tokens near it in the same chunk. So as each layer writes the
recomputed tokens' KV, every stale token of the chunk gets ``share`` times the mean correction of its
``window`` nearest recomputed tokens on each side (keys before RoPE, then rotated to the stale token's
position), before anything attends to it; ``window=0`` lends the single nearest one's. One neighbour's move is
a noisy estimate of the token's own; a mean over a few on both sides is a steadier one and bears a larger
share. Where every token is recomputed no token is stale, so the blend stays exact.
"""
from __future__ import annotations

import torch

from .layers import LayerOps
from .prompt import TokenizedPrompt
from .runner import KVCache

# A chunk's first tokens hold its private attention sink: their corrections are atypical of the chunk's body,
# so they neither lend a correction nor take one (the selectors recompute most of them anyway).
SINK_TOKENS = 4


class PropagatingCache(KVCache):
    """``cache`` (its tensors, shared) whose writes also correct the KV of the stale chunk tokens.

    keys_pre: [layers, KVH, N, D], the loaded chunks' keys before RoPE (``Blender.load``); kept in step with
    the corrections."""

    def __init__(self, cache: KVCache, tokens: TokenizedPrompt, reusable: torch.Tensor, share: float,
                 keys_pre: torch.Tensor, ops: LayerOps, window: int = 0):
        super().__init__(cache.k, cache.v, cache.k_pre)
        self.share, self.keys_pre, self.ops, self.window = share, keys_pre, ops, window
        n, device = len(tokens), reusable.device
        self.chunk = torch.full((n,), -1, device=device)
        eligible = torch.zeros(n, dtype=torch.bool, device=device)
        for seg in tokens.chunk_segments():
            self.chunk[seg.start:seg.end] = seg.chunk
            eligible[seg.start + SINK_TOKENS:seg.end] = True
        self.eligible = eligible & reusable
        self.fresh = torch.zeros((cache.v.shape[0], n), dtype=torch.bool, device=device)  # recomputed, per layer

    def write(self, layer: int, positions: torch.Tensor, k_pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        fresh = self.fresh[layer]
        first = self.eligible[positions] & ~fresh[positions]       # reused tokens recomputed here for the first time
        sources = positions[first]
        if sources.numel():
            dk = k_pre[:, first] - self.keys_pre[layer][:, sources]
            dv = v[:, first] - self.v[layer][:, sources]
        super().write(layer, positions, k_pre, k, v)
        fresh[positions] = True
        if not sources.numel():
            return
        targets, lenders, weights = self.lenders(sources, (self.eligible & ~fresh).nonzero().flatten())
        if not targets.numel():
            return
        weights = self.share * weights.to(dv.dtype)
        dk = torch.einsum("tj,htjd->htd", weights, dk[:, lenders])
        dv = torch.einsum("tj,htjd->htd", weights, dv[:, lenders])
        self.keys_pre[layer][:, targets] += dk
        self.k[layer][:, targets] += self.ops.rotate(dk[None], targets, first_layer=layer)[0]
        self.v[layer][:, targets] += dv

    def lenders(self, sources: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sorted ``sources`` and ``targets`` → (the targets that have a source in their chunk, [T, J] indices into
        ``sources`` of the ones each borrows from, [T, J] their weights, summing to 1 per target)."""
        i = torch.searchsorted(sources, targets)                   # the first source right of each target
        if self.window:
            index = i[:, None] + torch.arange(-self.window, self.window, device=i.device)
        else:                                                      # the nearest one; the left one on a tie
            last = sources.numel() - 1
            has_left, has_right = self._same_chunk(sources, targets, torch.stack([i - 1, i], 1)).unbind(1)
            nearer_right = sources[i.clamp(max=last)] - targets < targets - sources[(i - 1).clamp(min=0)]
            index = torch.where(has_right & (~has_left | nearer_right), i, i - 1)[:, None]
        ok = self._same_chunk(sources, targets, index)
        keep = ok.any(1)
        index = index.clamp(0, sources.numel() - 1)[keep]
        weights = ok[keep].float()
        return targets[keep], index, weights / weights.sum(1, keepdim=True)

    def _same_chunk(self, sources: torch.Tensor, targets: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """[T, J] indices into ``sources`` → whether each is a source in its target's chunk."""
        inside = (index >= 0) & (index < sources.numel())
        return inside & (self.chunk[sources[index.clamp(0, sources.numel() - 1)]] == self.chunk[targets][:, None])
