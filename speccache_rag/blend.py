"""The one blend pipeline, run by both engines: load and rotate stored chunks → choose → recompute → stats.

The torch engine runs it over HF modules (:class:`~speccache_rag.layers.HFLayers`) and decodes from
the cache it fills; the vLLM connector runs it over vLLM's modules and copies the cache into vLLM's
paged blocks. Which tokens are recomputed is ``SELECTORS[method]`` in both.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import DRAFT_METHODS, ReuseConfig
from .kv import ChunkKV, chunk_key, tenant_fingerprint
from .layers import LayerOps
from .neighbors import choose as neighbors_choose
from .output import GenerationStats
from .prompt import RAGPrompt, Segment, TokenizedPrompt
from .propagate import PropagatingCache
from .runner import KVCache, full_prefill, prefill
from .selection import SELECTORS, Selection, budget_for, hidden_states
from .store import KVStore


@dataclass
class Blended:
    logits: torch.Tensor | None     # of the last prompt token (None where the engine computes it itself)
    recomputed: torch.Tensor        # positions that went through the model
    missed: list[Segment]           # chunks not in the store (their tokens were recomputed)


class Blender:
    """Blends prompts for one target: its layer ops, the store, the fingerprint in every key, the sink
    (``sink_ids``: the target's tokens; ``sink``: the policy they came from, for a draft to read chunks alike).

    draft: () → (draft LayerOps, draft tokenizer), called only for methods that score with a draft.
    hidden_states / selector: what selectors use to run a plain prefill with capture and to resolve a
    method name (the bench passes memoized / experimental ones)."""

    def __init__(self, ops: LayerOps, store: KVStore, fingerprint: str, sink_ids: list[int],
                 draft: Callable[[], tuple[LayerOps, object]] | None = None,
                 hidden_states: Callable = hidden_states, selector: Callable[[str], Callable] = SELECTORS.__getitem__,
                 sink: str = "bos"):
        self.ops, self.store, self.fingerprint, self.sink_ids, self.sink = ops, store, fingerprint, sink_ids, sink
        self.draft, self.hidden_states, self.selector = draft, hidden_states, selector
        self.gate_failed: list[str] = []    # set by gate.run: then every request is served by full prefill
        self.model_fingerprint = fingerprint  # the model's, also under a tenant's salt (entries name it)

    def for_salt(self, cache_salt: str | None) -> "Blender":
        """This blender under a tenant's ``cache_salt``: every key it makes or reads is the tenant's
        (``kv.tenant_fingerprint``); gate verdict, store and models are shared."""
        if cache_salt is None:
            return self
        salted = copy.copy(self)
        salted.fingerprint = tenant_fingerprint(self.fingerprint, cache_salt)
        return salted

    @torch.inference_mode()
    def chunk_kv(self, token_ids: list[int], key: str, text: str, context_ids: list[int] = (),
                 context: list[str] = ()) -> ChunkKV:
        """The chunk prefilled alone (after the sink tokens, whose entries are dropped), keys before RoPE;
        with ``context_ids``, after those too (a variant: ``neighbors.py``; ``context``: their plain keys)."""
        head = self.sink_ids + list(context_ids)
        cache, _ = full_prefill(self.ops, torch.tensor(head + list(token_ids), device=self.ops.device), keep_pre_rope=True)
        entry = chunk_entry(cache, len(head), len(head) + len(token_ids), token_ids, key, text, self.fingerprint,
                            self.model_fingerprint)
        if context_ids:
            entry.meta.update(context_ids=list(context_ids), context=list(context))
        return entry

    def ensure_stored(self, token_ids: list[int], text: str, context_ids: list[int] = (),
                      context: list[str] = ()) -> tuple[str, bool]:
        """The one ingestion path: the chunk's key (covering ``context_ids`` for a variant), its KV computed and
        stored unless the store holds it → (key, whether it was new)."""
        key = chunk_key(self.fingerprint, token_ids, context_ids)
        if self.store.contains(key):
            return key, False
        self.store.put(self.chunk_kv(token_ids, key, text, context_ids, context))
        return key, True

    def load(self, tokens: TokenizedPrompt, cache: KVCache, stats: GenerationStats,
             keys: dict[int, str] | None = None, neighbors: str = "off",
             keys_pre: torch.Tensor | None = None) -> tuple[torch.Tensor, list[Segment]]:
        """Put every stored chunk's KV, rotated to its true positions, into ``cache`` → (reusable [N], missed);
        with ``keys_pre`` (``cache.k``'s shape over the prompt), the stored keys before RoPE there too.

        keys: chunk start → store key, where a caller already matched the chunk (its tokens may then be
        a prefix of the entry's: by causality the KV of a chunk's first tokens does not depend on the rest).
        neighbors: which variant with ingestion-time context to read, where the store holds some
        (``neighbors.choose``); the plain entry where none fits or the variant is gone."""
        reusable = torch.zeros(len(tokens), dtype=torch.bool, device=self.ops.device)
        missed = []
        segs = [s for s in tokens.chunk_segments() if s.end > s.start]  # vllm serve's spans may hold empty ones
        plain = {s.start: (keys or {}).get(s.start) or chunk_key(self.fingerprint, tokens.token_ids[s.start:s.end])
                 for s in segs}
        retrieved, order = set(plain.values()), list(plain.values())
        for i, seg in enumerate(segs):
            ids = tokens.token_ids[seg.start:seg.end]
            variant = neighbors_choose(self.store, plain[seg.start], order[:i], retrieved, neighbors)
            entry = self.store.get(variant) if variant else None
            if entry is None:
                entry = self.store.get(plain[seg.start])
            else:
                stats.context_variants += 1
            n = len(ids)
            if entry is None or entry.token_ids[:n] != ids:
                stats.cache_misses += 1
                missed.append(seg)
                continue
            stats.cache_hits += 1
            positions = torch.arange(seg.start, seg.end, device=self.ops.device)
            # stored KV lives on the host: it moves to the model's device once, here
            cache.k[:, :, seg.start:seg.end] = self.ops.rotate(entry.k[:, :, :n].to(cache.k), positions)
            cache.v[:, :, seg.start:seg.end] = entry.v[:, :, :n].to(cache.v)
            if keys_pre is not None:
                keys_pre[:, :, seg.start:seg.end] = entry.k[:, :, :n].to(keys_pre)
            reusable[seg.start:seg.end] = True
        return reusable, missed

    @torch.inference_mode()
    def blend(self, tokens: TokenizedPrompt, cache: KVCache, reuse: ReuseConfig, stats: GenerationStats,
              prompt: RAGPrompt | None = None, keys: dict[int, str] | None = None) -> Blended:
        """Fill ``cache`` for every prompt position by ``reuse.method`` (full prefill where the model failed
        the correctness gate); statistics go into ``stats``."""
        n = len(tokens)
        if self.gate_failed and reuse.method != "full":
            reuse, stats.method = ReuseConfig(method="full"), "full"
        if reuse.method == "full":
            t = time.perf_counter()
            everything = torch.arange(n, device=self.ops.device)
            logits = prefill(self.ops, cache, tokens.ids, everything)
            stats.recompute_s, stats.recomputed_tokens = time.perf_counter() - t, n
            return Blended(logits, everything, [])

        t = time.perf_counter()
        # measured on llama/qwen2-style models; with QK-norm (Gemma3: worse than none on its test prompt, even on
        # values alone; Qwen3: not measured) the stale tokens keep their stored KV
        propagate = 0.0 if self.ops.qk_norm else reuse.propagate
        keys_pre = torch.empty_like(cache.k[:, :, :n]) if propagate else None
        reusable, missed = self.load(tokens, cache, stats, keys, reuse.neighbors, keys_pre)
        stats.load_s = time.perf_counter() - t
        draft, draft_tokenizer = self.draft() if reuse.method in DRAFT_METHODS and self.draft else (None, None)
        sel = Selection(tokens, reusable, budget_for(reuse.recompute_ratio, int(reusable.sum()), reuse), reuse,
                        prompt=prompt, draft=draft, draft_tokenizer=draft_tokenizer, hidden_states=self.hidden_states,
                        sink=self.sink)
        t = time.perf_counter()
        if propagate:
            cache = PropagatingCache(cache, tokens, reusable, propagate, keys_pre, self.ops, reuse.propagate_window)
        logits, recomputed = self.selector(reuse.method)(self.ops, cache, sel, (~reusable).nonzero().flatten())
        stats.draft_s = sel.timings.get("select_s", 0.0)
        stats.draft_forward_s = sel.timings.get("draft_forward_s", 0.0)
        stats.recompute_s = time.perf_counter() - t - stats.draft_s
        stats.recomputed_tokens = recomputed.numel()
        stats.reused_tokens = n - stats.recomputed_tokens
        return Blended(logits, recomputed, missed)

    def store_missed(self, tokens: TokenizedPrompt, missed: list[Segment], stats: GenerationStats) -> None:
        """Compute each missed chunk alone and store it, so the next prompt finds it."""
        t = time.perf_counter()
        for seg in missed:
            stats.stored_chunks += self.ensure_stored(tokens.token_ids[seg.start:seg.end], seg.text)[1]
        stats.fill_s += time.perf_counter() - t


def chunk_entry(cache: KVCache, start: int, end: int, token_ids: list[int], key: str, text: str,
                fingerprint: str, model: str | None = None) -> ChunkKV:
    """Positions [start, end) of a cache filled with ``keep_pre_rope`` as a store entry. The model
    fingerprint rides along so that ``speccache-rag store verify`` can name entries of unknown models."""
    host = dict(device="cpu", copy=True)          # the store keeps host tensors, whatever device computed them
    return ChunkKV(key, list(token_ids), cache.k_pre[:, :, start:end].to(**host), cache.v[:, :, start:end].to(**host),
                   meta={"text": text, "fingerprint": fingerprint,
                         **({"model": model} if model and model != fingerprint else {})})
