"""Worker side of the connector: one request's prompt KV blended by the core pipeline, then paged.

:class:`speccache_rag.blend.Blender` does the work, over vLLM's own modules
(:class:`~.layers.VllmLayers`); this adds what only the connector has: prompts known as token ids and
chunk spans (no RAGPrompt), the precompute requests, and the copy into vLLM's paged cache.
"""
from __future__ import annotations

import torch

from ..blend import Blender, chunk_entry
from ..config import DRAFT_METHODS, ReuseConfig
from ..gate import Verdict, run as run_gate
from ..hardware import dtype_name
from ..kv import chunk_key
from ..layers import HFLayers
from ..output import GenerationStats
from ..prompt import RAGPrompt, TokenizedPrompt, render, segments_from_spans, sink_token_ids
from ..runner import KVCache
from .layers import VllmLayers, write_paged


class PagedBlender:
    """Everything one worker needs to blend requests: the core Blender over vLLM's modules, the tokenizer,
    and the draft (loaded on first use)."""

    def __init__(self, model, tokenizer, store, fingerprint: str, sink_ids: list[int], draft_loader,
                 fill_misses: bool = True, sink: str = "bos"):
        self.ops, self.tokenizer, self.fill_misses = VllmLayers(model), tokenizer, fill_misses
        self._draft_loader, self._draft = draft_loader, None
        self.core = Blender(self.ops, store, fingerprint, sink_ids, draft=self.draft, sink=sink)

    @classmethod
    def start(cls, model, model_dir: str, dtype, store, fingerprint: str, options, logger) -> "PagedBlender":
        """A worker's blender, ready before its first request: the correctness gate has run (``options.gate``)
        and the draft is loaded where the configured method needs one, so no request pays for either."""
        from ..models import load, load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        draft_name = options.draft or model_dir

        def load_draft():
            logger.info("SpecCache: loading draft model %s", draft_name)
            return load(draft_name, dtype=dtype)

        blender = cls(model, tokenizer, store, fingerprint, sink_token_ids(tokenizer, options.sink), load_draft,
                      fill_misses=options.fill_misses, sink=options.sink)
        if options.gate:
            verdict = blender.check_gate(model_dir)
            if verdict.failed:
                logger.warning("SpecCache: %s", verdict.warning(model_dir))
        if options.method in DRAFT_METHODS and not blender.core.gate_failed:
            blender.draft()
        return blender

    def check_gate(self, model_name: str) -> Verdict:
        """The correctness gate over vLLM's modules (``gate.run``), applied to the core blender. A draft loaded
        only for the check is let go again."""
        had_draft = self._draft is not None
        verdict = run_gate(self.core, self.tokenizer, "vllm", model_name)
        if not had_draft:
            self._draft = None
        return verdict

    def draft(self):
        if self._draft is None:
            model, tokenizer = self._draft_loader()
            self._draft = HFLayers(model), tokenizer
        return self._draft

    def tokens(self, token_ids: list[int], spans: list, prompt: RAGPrompt | None) -> tuple[TokenizedPrompt, RAGPrompt | None]:
        """The prompt's segments: the torch engine's own when ``prompt`` renders to exactly these tokens
        (then the draft reads it the same way too), else the spans' (the rest is template text)."""
        if prompt is not None:
            rendered = render(prompt, self.tokenizer)
            if rendered.token_ids == list(token_ids):
                return rendered, prompt
        return segments_from_spans(self.tokenizer, list(token_ids), [(int(sp[0]), int(sp[1])) for sp in spans]), None

    @torch.inference_mode()
    def blend(self, token_ids: list[int], spans: list, reuse: ReuseConfig, slots: torch.Tensor,
              prompt: RAGPrompt | None = None, precompute: bool = False,
              cache_salt: str | None = None) -> GenerationStats:
        """Blend every prompt position, then write positions [0, len(slots)) into the paged cache (vLLM
        computes the last prompt token again itself, attending to them).

        spans: [start, end] per chunk, or [start, end, key] when the scheduler found it in the store
        (then [start, end) may be a prefix of that entry's tokens). precompute: the request is
        [sink] + chunk + one token, whose chunk KV is stored. cache_salt: the request's tenant, whose keys alone
        it reads and writes."""
        core = self.core.for_salt(cache_salt)
        tokens, prompt = self.tokens(token_ids, spans, prompt)
        stats = GenerationStats(method="precompute" if precompute else reuse.method, prompt_tokens=len(tokens),
                                dtype=dtype_name(self.ops.dtype))
        cache = KVCache.empty(self.ops, len(tokens), keep_pre_rope=precompute)
        if precompute:
            core.blend(tokens, cache, ReuseConfig(method="full"), stats)
            write_paged(self.ops, cache, slots)
            self._store_precomputed(core, tokens, cache, stats)
            return stats
        keys = {int(sp[0]): sp[2] for sp in spans if len(sp) > 2}
        blended = core.blend(tokens, cache, reuse, stats, prompt=prompt, keys=keys)
        write_paged(self.ops, cache, slots)
        if self.fill_misses:
            core.store_missed(tokens, blended.missed, stats)
        return stats

    @staticmethod
    def _store_precomputed(core: Blender, tokens: TokenizedPrompt, cache: KVCache, stats: GenerationStats) -> None:
        sink = core.sink_ids
        for seg in tokens.chunk_segments():
            ids = tokens.token_ids[seg.start:seg.end]
            key = chunk_key(core.fingerprint, ids)
            if seg.start == len(sink) and tokens.token_ids[:seg.start] == sink:
                entry = chunk_entry(cache, seg.start, seg.end, ids, key, seg.text,      # the chunk's KV alone
                                    core.fingerprint, core.model_fingerprint)
            else:
                entry = core.chunk_kv(ids, key, seg.text)
            core.store.put(entry)
            stats.stored_chunks += 1


__all__ = ["PagedBlender"]
