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
        chunks = [seg for seg in tokens.chunk_segments() if seg.end > seg.start]
        # Corrections are added over the one span from the first chunk to the last, as dense slices: cheaper on a
        # CPU than scattering into the stale tokens alone, and a zero correction leaves a token as it was.
        self.span = slice(chunks[0].start, chunks[-1].end) if chunks else slice(0, 0)
        device = reusable.device
        self.span_positions = torch.arange(self.span.start, self.span.stop, device=device)
        self.rope = ops.rope(self.span_positions, keys_pre)                  # every layer rotates to these positions
        # which chunk segment a token is in, counted in prompt order: sorted sources then have sorted segments
        self.segment = torch.full((len(tokens),), -1, device=device)
        eligible = torch.zeros(len(tokens), dtype=torch.bool, device=device)
        for i, seg in enumerate(chunks):
            self.segment[seg.start:seg.end] = i
            eligible[seg.start + SINK_TOKENS:seg.end] = True
        self.eligible = eligible & reusable
        self.fresh = torch.zeros((cache.v.shape[0], len(tokens)), dtype=torch.bool, device=device)  # per layer

    def write(self, layer: int, positions: torch.Tensor, k_pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        fresh = self.fresh[layer]
        first = self.eligible[positions] & ~fresh[positions]       # reused tokens recomputed here for the first time
        sources = positions[first]
        if sources.numel():
            # keys and values side by side, in float32: the means below are differences of running sums
            moves = torch.cat([k_pre[:, first] - self.keys_pre[layer][:, sources],
                               v[:, first] - self.v[layer][:, sources]], -1).float()
        super().write(layer, positions, k_pre, k, v)
        fresh[positions] = True
        if not sources.numel():
            return
        lo, hi = self.lenders(sources)
        stale = (self.eligible & ~fresh)[self.span] & (hi > lo)
        # Stale tokens between the same two sources borrow the same mean: each is computed once, in float32 as a
        # difference of running sums, then spread over its tokens (the rest read a zero row).
        ranges, spread = torch.unique_consecutive(lo * (sources.numel() + 1) + hi, return_inverse=True)
        lo, hi = ranges // (sources.numel() + 1), ranges % (sources.numel() + 1)
        running = torch.cat([moves.new_zeros(moves.shape[0], 1, moves.shape[2]), moves.cumsum(1)], 1)
        means = (running[:, hi] - running[:, lo]) * (self.share / (hi - lo).clamp(min=1))[:, None]
        means = torch.cat([means, means.new_zeros(means.shape[0], 1, means.shape[2])], 1).to(self.v.dtype)
        dk, dv = means.index_select(1, torch.where(stale, spread, len(ranges))).split([k_pre.shape[-1], v.shape[-1]], -1)
        self.keys_pre[layer][:, self.span] += dk
        self.k[layer][:, self.span] += self.ops.rotate(dk[None], self.span_positions, layer, self.rope)[0]
        self.v[layer][:, self.span] += dv

    def lenders(self, sources: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sorted ``sources`` → for each token of the span, the range [lo, hi) of ``sources`` it borrows from: in
        its chunk, ``window`` on each side or the nearest one; empty where its chunk has none."""
        targets = self.span_positions
        i = torch.searchsorted(sources, targets)                   # the first source right of each token
        segment, of_sources = self.segment[self.span], self.segment[sources]
        first = torch.searchsorted(of_sources, segment)            # the chunk's sources: [first, end)
        end = torch.searchsorted(of_sources, segment, right=True)
        if self.window:
            lo, hi = torch.maximum(i - self.window, first), torch.minimum(i + self.window, end)
        else:                                                      # the nearest one; the left one on a tie
            last = sources.numel() - 1
            nearer_right = sources[i.clamp(max=last)] - targets < targets - sources[(i - 1).clamp(min=0)]
            lo = torch.where((i < end) & ((i == first) | nearer_right), i, i - 1)
            hi = lo + 1
        has = end > first
        return torch.where(has, lo, 0), torch.where(has, hi, 0)
