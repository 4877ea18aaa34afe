"""Stale chunk tokens borrow the KV correction of their nearest recomputed neighbour (issue 24).

A reused chunk token that is not recomputed keeps the keys and values it got without the rest of the prompt.
The recomputed tokens show, layer by layer, how far the missing context moves them, and on real passages a
token's move resembles that of the recomputed token nearest to it in the same chunk. So as each layer writes
the recomputed tokens' KV, every stale token of the chunk gets ``share`` times the correction of its nearest
recomputed neighbour (keys before RoPE, then rotated to the stale token's position), before anything attends
to it. Where every token is recomputed no token is stale, so the blend stays exact.

``share="auto"`` fits the share per layer, for keys and values apart, and by the distance to the neighbour: the
recomputed tokens of a layer show how well one token's correction predicts its nearest recomputed
neighbour's (the least-squares factor over those pairs), and a stale token at distance d takes the factor
fitted on pairs about that far apart. On real passages the factor falls with depth and with distance, and the
one fitted on recomputed pairs tracks the one that would have been right for the stale tokens.
"""
from __future__ import annotations

import torch

from .layers import LayerOps
from .prompt import TokenizedPrompt
from .runner import KVCache

# A chunk's first tokens hold its private attention sink: their corrections are atypical of the chunk's body,
# so they neither lend a correction nor take one (the selectors recompute most of them anyway).
SINK_TOKENS = 4
# share="auto": pairs are fitted by distance, in bins [1, 2), [2, 4), [4, 8), [8, ∞); a bin holding fewer pairs
# than MIN_PAIRS takes the factor of the bin before it (factors fall with distance: the nearer bin errs high)
BIN_EDGES = (2, 4, 8)
MIN_PAIRS = 16


class PropagatingCache(KVCache):
    """``cache`` (its tensors, shared) whose writes also correct the KV of the stale chunk tokens.

    keys_pre: [layers, KVH, N, D], the loaded chunks' keys before RoPE (``Blender.load``); kept in step with
    the corrections."""

    def __init__(self, cache: KVCache, tokens: TokenizedPrompt, reusable: torch.Tensor, share: float | str,
                 keys_pre: torch.Tensor, ops: LayerOps):
        super().__init__(cache.k, cache.v, cache.k_pre)
        self.share, self.keys_pre, self.ops = share, keys_pre, ops
        n, device = len(tokens), reusable.device
        self.chunk = torch.full((n,), -1, device=device)
        eligible = torch.zeros(n, dtype=torch.bool, device=device)
        for seg in tokens.chunk_segments():
            self.chunk[seg.start:seg.end] = seg.chunk
            eligible[seg.start + SINK_TOKENS:seg.end] = True
        self.eligible = eligible & reusable
        self.fresh = torch.zeros((cache.v.shape[0], n), dtype=torch.bool, device=device)  # recomputed, per layer
        self.edges = torch.tensor(BIN_EDGES, device=device)

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
        targets, nearest = self.nearest(sources, (self.eligible & ~fresh).nonzero().flatten())
        if not targets.numel():
            return
        if self.share == "auto":
            bins = torch.bucketize((targets - sources[nearest]).abs(), self.edges, right=True)
            share_k, share_v = self.fitted(sources, dk), self.fitted(sources, dv)
            dk, dv = dk[:, nearest] * share_k[bins, None], dv[:, nearest] * share_v[bins, None]
        else:
            dk, dv = self.share * dk[:, nearest], self.share * dv[:, nearest]
        self.keys_pre[layer][:, targets] += dk
        self.k[layer][:, targets] += self.ops.rotate(dk[None], targets, first_layer=layer)[0]
        self.v[layer][:, targets] += dv

    def nearest(self, sources: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sorted ``sources`` and ``targets`` → (the targets that have a source in their chunk, the index into
        ``sources`` of the nearest one; the left one on a tie)."""
        i = torch.searchsorted(sources, targets)
        left, right = (i - 1).clamp(min=0), i.clamp(max=sources.numel() - 1)
        chunk = self.chunk[targets]
        has_left = (i > 0) & (self.chunk[sources[left]] == chunk)
        has_right = (i < sources.numel()) & (self.chunk[sources[right]] == chunk)
        take_right = has_right & (~has_left | (sources[right] - targets < targets - sources[left]))
        keep = has_left | has_right
        return targets[keep], torch.where(take_right, right, left)[keep]

    def fitted(self, sources: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """Sorted ``sources`` and their corrections [KVH, S, D] → the least-squares factor, per distance bin, by
        which a source's nearest other source in its chunk predicts its correction, clamped to [0, 1]."""
        s = sources.numel()
        i = torch.arange(s, device=sources.device)
        same_left = (i > 0) & (self.chunk[sources[(i - 1).clamp(min=0)]] == self.chunk[sources])
        same_right = (i < s - 1) & (self.chunk[sources[(i + 1).clamp(max=s - 1)]] == self.chunk[sources])
        gap_left = sources - sources[(i - 1).clamp(min=0)]
        gap_right = sources[(i + 1).clamp(max=s - 1)] - sources
        take_right = same_right & (~same_left | (gap_right < gap_left))
        keep = same_left | same_right
        a, b = i[keep], torch.where(take_right, i + 1, i - 1)[keep]
        bins = torch.bucketize(torch.where(take_right, gap_right, gap_left)[keep], self.edges, right=True)
        n = len(BIN_EDGES) + 1
        cross = torch.zeros(n, dtype=torch.float64, device=d.device).index_add_(
            0, bins, (d[:, a] * d[:, b]).sum((0, 2)).double())
        norm = torch.zeros_like(cross).index_add_(0, bins, d[:, b].pow(2).sum((0, 2)).double())
        count = torch.zeros(n, dtype=torch.long, device=d.device).index_add_(0, bins, torch.ones_like(bins))
        factor = (cross / norm.clamp_min(1e-12)).clamp(0.0, 1.0)
        all_pairs = float((cross.sum() / norm.sum().clamp_min(1e-12)).clamp(0.0, 1.0))
        shares, last = [], all_pairs
        for j in range(n):
            last = float(factor[j]) if count[j] >= MIN_PAIRS else last
            shares.append(last)
        return torch.tensor(shares, dtype=d.dtype, device=d.device)
