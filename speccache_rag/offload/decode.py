"""The SpeCache decode loop over two-tier KV (arXiv 2503.16163; method and checks: docs/offload.md).

Each step runs two tokens through the one layer loop: the token just decoded, T_t, and a speculative
guess of the next, T′_{t+1} (the last step's second row). Attention is dense over the whole cache — the
low-bit copy, with last step's fetched rows at full precision — and the output row cannot see the
speculative one (causal by position). The speculative row's attention, averaged over the query heads of each KV group, names the
top-k rows to fetch for the next step; only T_t's K/V is kept. The first output token, which has no
guess yet, runs once alone over the low-bit cache (the pre-decode pass): its attention chooses the first
fetch and its logits the first guess. ``speculative=False`` is the ablation: one token per step, the
next fetch chosen by this token's own attention (the previous token's, seen from the next one).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..config import OffloadConfig
from ..layers import LayerOps
from ..output import OffloadStats
from ..runner import KVCache, run_layers
from .tiers import LayerTiers


class _StepCache:
    """The runner's cache for one step: each layer reads its mixed-precision cache plus the step's rows."""

    def __init__(self, tiers: list[LayerTiers]):
        self.tiers = tiers
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, layer, positions, k_pre, k, v) -> None:
        self.new[layer] = (k, v)

    def read(self, layer: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.tiers[layer].mixed()
        new_k, new_v = self.new[layer]
        return torch.cat([k, new_k], 1), torch.cat([v, new_v], 1)


def group_attention(q: torch.Tensor, keys: torch.Tensor, scale: float, row: int, visible: int) -> torch.Tensor:
    """Attention probabilities (fp32) of query row ``row`` [H, S, D] over the first ``visible`` keys
    [KVH, T, D], averaged over the query heads of each KV group → [KVH, visible]."""
    kvh = keys.shape[0]
    qr = q[:, row].float().reshape(kvh, -1, q.shape[-1])                 # [KVH, G, D]
    logits = torch.einsum("kgd,ktd->kgt", qr, keys[:, :visible].float()) * scale
    return logits.softmax(-1).mean(1)


def _overlap(a: torch.Tensor, b: torch.Tensor, size: int) -> float:
    """|a ∩ b| / |b| for index sets a, b [KVH, j] (per head, then pooled)."""
    seen = torch.zeros((a.shape[0], size), dtype=torch.bool, device="cpu")     # a statistic: on the host
    seen.scatter_(1, a.cpu(), True)
    return float(seen.gather(1, b.cpu()).float().mean()) if b.numel() else 0.0


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


class OffloadDecoder:
    """Decodes over a prefilled cache moved into two tiers: ``step(token, position)`` → next-token logits.

    ``cache`` holds ``length`` prefilled tokens and room for ``capacity``; its rows past ``length`` are the
    decoder's from now on."""

    def __init__(self, ops: LayerOps, cache: KVCache, length: int, cfg: OffloadConfig, capacity: int):
        self.ops, self.cfg = ops, cfg
        # on CPU the prefilled cache itself becomes the host tier (RAM either way); elsewhere it is copied
        # out and the caller can drop it
        self.tiers = [LayerTiers(cache.k[i], cache.v[i], cfg, capacity, length) for i in range(ops.num_layers)]
        self.length = length
        self.spec: int | None = None          # the next step's speculative token (the last step's second row)
        self._guess: int | None = None        # the speculative token of the last step, to score against T_t
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="speccache-prefetch") if cfg.prefetch == "async" else None
        self._hits: list[float] = []
        self._oracle_hits: list[float] = []
        self._spec_hits = self._steps = 0
        self._decode_s = 0.0

    @torch.inference_mode()
    def step(self, token_id: int, position: int) -> torch.Tensor:
        """Append ``token_id`` at ``position`` (the number of tokens held) → logits for the next token."""
        if position != self.length:
            raise ValueError(f"the offloaded cache holds {self.length} tokens; cannot decode at position {position}")
        t = time.perf_counter()
        if not self._steps:                   # pre-decode: T1 alone over the low-bit cache → κ1 (and T′2)
            (first,), _, chosen = self._forward([token_id], select_row=0, measure=False)
            self.spec = int(first.argmax())
            self._fetch(chosen)
        if self.cfg.speculative:
            if self._guess is not None:
                self._spec_hits += int(self._guess == token_id)
            self._guess = self.spec
            (logits, spec_logits), new, chosen = self._forward([token_id, self.spec], select_row=1)
            self.spec = int(spec_logits.argmax())
        else:
            (logits,), new, chosen = self._forward([token_id], select_row=0)
        for tiers, (k, v) in zip(self.tiers, new):
            tiers.append(k[:, 0], v[:, 0])
        self.length += 1
        self._fetch(chosen)
        self._steps += 1
        self._decode_s += time.perf_counter() - t
        return logits

    def _forward(self, ids: list[int], select_row: int, measure: bool = True):
        """Run ``ids`` at the next positions → (logits per row, each layer's new (k, v), each layer's top-k)."""
        n, cfg = self.length, self.cfg
        view = _StepCache(self.tiers)
        chosen: list[torch.Tensor] = []

        def observe(layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
            tiers = self.tiers[layer]
            j = min(cfg.topk, tiers.nk)       # only rows held at low precision are worth fetching
            probs = group_attention(q, keys, self.ops.scaling, select_row, n + select_row + 1)
            chosen.append(probs[:, :tiers.nk].topk(j, dim=-1).indices)
            if not measure or j == 0 or not tiers.fetched.shape[1]:
                return                        # nothing was fetched for this step: no hit to count
            own = probs if select_row == 0 else group_attention(q, keys, self.ops.scaling, 0, n + 1)
            self._hits.append(_overlap(tiers.fetched, own[:, :tiers.nk].topk(j, dim=-1).indices, tiers.nk))
            if cfg.oracle:
                exact = torch.cat([tiers.host_k[:, :n].to(keys.device), keys[:, n:n + 1]], 1)
                best = group_attention(q, exact, self.ops.scaling, 0, n + 1)[:, :tiers.nk].topk(j, dim=-1).indices
                self._oracle_hits.append(_overlap(tiers.fetched, best, tiers.nk))

        positions = torch.arange(n, n + len(ids), device=self.ops.device)
        h = run_layers(self.ops, view, self.ops.embed(torch.tensor(ids, device=self.ops.device)), positions,
                       observe=observe)
        logits = [self.ops.logits(h[r]) for r in range(len(ids))]
        return logits, [view.new[i] for i in range(self.ops.num_layers)], chosen

    def _fetch(self, chosen: list[torch.Tensor]) -> None:
        for tiers, idx in zip(self.tiers, chosen):
            if self._pool is None:
                tiers.fetch(idx)
            else:
                tiers.fetch_async(idx, self._pool)

    def stats(self) -> OffloadStats:
        for tiers in self.tiers:
            tiers.wait()
        resident = sum(t.resident_bytes() for t in self.tiers)
        full = sum(2 * t.kvh * t.n * t.d * t.host_k.element_size() for t in self.tiers)
        fetched = sum(t.fetched_bytes for t in self.tiers)
        return OffloadStats(
            bits=self.cfg.bits, topk=self.cfg.topk, speculative=self.cfg.speculative, steps=self._steps,
            resident_bytes=resident, full_kv_bytes=full, resident_ratio=resident / max(1, full),
            fetched_bytes_per_step=fetched / max(1, self._steps), prefetch_hit_rate=_mean(self._hits),
            oracle_hit_rate=_mean(self._oracle_hits),
            spec_token_hit_rate=self._spec_hits / (self._steps - 1) if self.cfg.speculative and self._steps > 1 else None,
            decode_tokens_per_s=self._steps / self._decode_s if self._decode_s else 0.0)

    def close(self) -> None:
        for tiers in self.tiers:
            tiers.wait()
        if self._pool is not None:
            self._pool.shutdown()
