"""SpecCacheEngine: precompute chunk KV once, then answer RAG prompts by blending it."""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial

import torch

from .config import DEFAULT_STORE, GenerationConfig, OffloadConfig, ReuseConfig
from .contract import Engine, check_sink, chunk_texts
from .hardware import check_device, configure_threads, dtype_name, resolve_dtype
from .blend import Blender
from .engines import engine_class
from . import neighbors
from .kv import ChunkKV, chunk_key, model_fingerprint
from .layers import HFLayers, attention_span
from .offload import OffloadDecoder
from .output import GenerationOutput, GenerationStats, GenerationStream, LoadStats
from .prompt import RAGPrompt, TokenizedPrompt, render, sink_token_ids, tokenize_piece
from .runner import KVCache, decode_one
from .sampling import StopTextBuffer, sample
from .store import KVStore, open_store


class SpecCacheEngine(Engine):
    """Reuses per-chunk KV caches for RAG prompts and repairs them by recomputing chosen tokens.

    Build it with :meth:`from_pretrained`; call :meth:`precompute` at ingestion and
    :meth:`generate` / :meth:`stream` at query time. Building runs the correctness gate (``gate``, verdict
    kept in the store) or else a warm-up pass (``warm_up``), timed in ``load_stats``; an engine that only
    precomputes may turn both off.
    """

    def __init__(self, target, tokenizer, store: KVStore | str = "memory://", draft=None, draft_tokenizer=None,
                 sink: str = "bos", fill_misses: bool = True, name: str | None = None, gate: bool = True,
                 warm_up: bool = True):
        check_sink(sink)
        self.target, self.tokenizer, self.ops = target, tokenizer, HFLayers(target)
        self.draft, self.draft_tokenizer = (draft, draft_tokenizer) if draft is not None else (target, tokenizer)
        self.draft_ops = HFLayers(draft) if draft is not None else self.ops
        self.store = open_store(store)
        self.sink = sink
        self.fill_misses = fill_misses
        self.name = name or getattr(target.config, "_name_or_path", "") or target.config.model_type
        self.fingerprint = model_fingerprint(target, tokenizer, sink)
        self.context_window = attention_span(target.config)
        self.dtype = dtype_name(next(target.parameters()).dtype)
        self.blender = Blender(self.ops, self.store, self.fingerprint, sink_token_ids(tokenizer, sink),
                               draft=lambda: (self.draft_ops, self.draft_tokenizer), sink=sink)
        self._eos_ids = self._eos_token_ids()
        # One-time costs are paid here, so that the first request's TTFT means what the hundredth's does.
        self.load_stats = LoadStats()
        if gate:
            self._check_gate()
        if warm_up and (not gate or self.load_stats.gate_from_store):  # a gate that ran warmed every path
            self._warm_up()

    @classmethod
    def from_pretrained(cls, target: str, draft: str | None = None, store: KVStore | str = DEFAULT_STORE,
                        backend: str = "torch", dtype: torch.dtype | str = "auto", threads: int | None = None,
                        device: str | torch.device | None = None, draft_device: str | torch.device | None = None,
                        **kwargs) -> "SpecCacheEngine":
        """target/draft: a packaged name ("smollm2-135m", "qwen2.5-coder-0.5b", …), an HF directory or a .gguf
        file; draft=None scores with the target itself. store: a directory, "memory://" or "redis://…".
        dtype: "auto" (bfloat16 where the hardware computes it natively, else float32), or a dtype.
        threads: torch intra-op threads (default: $SPECCACHE_THREADS, $OMP_NUM_THREADS, or the usable cores).
        device: where the target computes (default: CUDA where there is one, else the CPU); draft_device: the
        draft's (default: the target's). Stored KV stays on the host and moves to the device once per chunk."""
        configure_threads(threads)
        if backend != "torch":    # by name (engines.BACKENDS): vllm is an optional extra above this module
            if backend == "remote":
                raise ValueError("a remote engine is opened by engines.open_engine(target, base_url=...)")
            if device is not None or draft_device is not None:
                raise ValueError(f"device= places the torch engine's models; backend={backend!r} places its own")
            return engine_class(backend)(target, draft=draft, store=store, dtype=resolve_dtype(dtype), name=target,
                                         **kwargs)
        device = check_device(device)
        draft_device = check_device(draft_device) if draft_device is not None else device
        dtype = resolve_dtype(dtype, device)
        from .models import load

        t = time.perf_counter()
        model, tok = load(target, dtype=dtype)
        model.to(device)
        draft_model, draft_tok = (None, None) if draft in (None, target) else load(draft, dtype=dtype)
        if draft_model is not None:
            draft_model.to(draft_device)
        loaded = time.perf_counter() - t
        engine = cls(model, tok, store=store, draft=draft_model, draft_tokenizer=draft_tok, name=target, **kwargs)
        engine.load_stats.model_load_s = loaded
        return engine

    # ---- ingestion ------------------------------------------------------------------------------
    def precompute(self, texts: Iterable[str], progress: bool = False,
                   context: Sequence[Sequence[str]] | None = None, cache_salt: str | None = None,
                   singles: bool = True) -> list[str]:
        """Compute and store the KV of each chunk text (idempotent); returns their (plain) keys in order.

        context: for each text, the texts to prefill it after as well — its nearest neighbours in the
        corpus (``neighbors.nearest`` over the ingestion embeddings) — stored as a variant beside the plain
        entry; queries that retrieve those neighbours too read the variant (``ReuseConfig.neighbors``).
        singles: where a text has several, also one variant after each alone, so that a prompt which
        retrieved only some of them ahead of the chunk still finds one it may read (on by default: with
        two neighbours, 4.0 instead of 1.4 of 6 MuSiQue chunks read a variant and the 1.5B's KL gap closed
        rose from 76 % to 85 %, for twice the ingestion prefill; docs/benchmarks.md).
        cache_salt: the tenant the chunks are stored for (only requests with the same salt reuse them)."""
        from tqdm.auto import tqdm

        texts = chunk_texts(texts)
        if context is not None and len(context) != len(texts):
            raise ValueError(f"context has {len(context)} entries for {len(texts)} texts: give one list per text")
        blender = self.blender.for_salt(cache_salt)
        keys = []
        for i, text in enumerate(tqdm(texts, desc="precompute KV", unit="chunk", disable=not progress)):
            ids, _ = tokenize_piece(self.tokenizer, text)
            self.check_chunk_fits(len(ids), len(blender.sink_ids))
            key, _ = blender.ensure_stored(ids, text)
            if context is not None and context[i]:
                ctx = list(context[i])
                for variant in [ctx] + ([[c] for c in ctx] if singles and len(ctx) > 1 else []):
                    self._precompute_variant(blender, ids, key, text, variant)
            keys.append(key)
        return keys

    def _precompute_variant(self, blender: Blender, ids: list[int], key: str, text: str, context: list[str]) -> None:
        if any(not isinstance(c, str) or not c.strip() for c in context):
            raise ValueError("context texts must be non-empty strings")
        ctx_ids = neighbors.context_ids(self.tokenizer, context)
        if len(ctx_ids) + len(ids) + len(self.blender.sink_ids) > self.context_window:
            raise ValueError(f"a chunk of {len(ids)} tokens after {len(ctx_ids)} tokens of context exceeds the "
                             f"context window of {self.context_window} tokens; pass fewer neighbours")
        ctx_keys = [chunk_key(blender.fingerprint, tokenize_piece(self.tokenizer, c)[0]) for c in context]
        vkey, _ = blender.ensure_stored(ids, text, ctx_ids, ctx_keys)
        neighbors.register(self.store, key, vkey, ctx_keys)

    def chunk_kv(self, token_ids: list[int], key: str, text: str) -> ChunkKV:
        """The chunk prefilled alone (after the sink tokens, whose entries are dropped), keys before RoPE."""
        return self.blender.chunk_kv(token_ids, key, text)

    # ---- query ----------------------------------------------------------------------------------
    def stream(self, prompt: RAGPrompt, max_new_tokens: int = 64, reuse: ReuseConfig | None = None,
               temperature: float = 0.0, top_p: float = 1.0, stop: Iterable[str] | str | None = None,
               seed: int | None = None, return_first_logits: bool = False,
               offload: OffloadConfig | str | None = None, cache_salt: str | None = None) -> "GenerationStream":
        """An iterator of text pieces as they are generated; its ``.output`` holds the result once it is done.

        Everything about the request lives in the iterator, so one engine serves many threads and
        interleaved streams. Chunks that missed the store are stored when the generation ends, also when
        the caller abandons the stream, so the next request finds them. ``offload`` ("2bit", "1bit" or an
        :class:`OffloadConfig`) decodes over SpeCache's two-tier KV after the (blended) prefill. ``cache_salt``:
        the tenant — only chunks stored under the same salt are reused, and missed ones are stored under it."""
        start = time.perf_counter()
        req = self.request(prompt, max_new_tokens, reuse, temperature, top_p, stop, seed, return_first_logits, offload,
                           cache_salt)
        tokens = render(req.prompt, self.tokenizer)
        self.check_fits(len(tokens), req.gen.max_new_tokens)
        stream = GenerationStream()
        stream._pieces = self._run(stream, self.blender.for_salt(cache_salt), req.prompt, tokens, req.gen,
                                   req.reuse or ReuseConfig(), return_first_logits, start, req.offload)
        return stream

    def _run(self, stream: "GenerationStream", blender: Blender, prompt: RAGPrompt, tokens: TokenizedPrompt,
             gen: GenerationConfig, reuse: ReuseConfig, return_first_logits: bool, start: float,
             offload: OffloadConfig | None) -> Iterator[str]:
        stats = GenerationStats(method=reuse.method, prompt_tokens=len(tokens), dtype=self.dtype)
        cache = KVCache.empty(self.ops, len(tokens) + gen.max_new_tokens)
        blended = blender.blend(tokens, cache, reuse, stats, prompt=prompt)
        first_logits = blended.logits

        generator = torch.Generator().manual_seed(gen.seed) if gen.seed is not None else None
        t = time.perf_counter()
        next_id = sample(first_logits, gen.temperature, gen.top_p, generator)
        stats.first_decode_s = time.perf_counter() - t
        stats.ttft_s = time.perf_counter() - start
        decoder, step = None, partial(decode_one, self.ops, cache)
        if offload:   # the two tiers hold the KV from here on
            decoder = OffloadDecoder(self.ops, cache, len(tokens), offload, cache.k.shape[2])
            step = decoder.step
        del cache
        try:
            yield from self._decode(stream, step, len(tokens), next_id, generator, gen, stats, start,
                                    first_logits if return_first_logits else None)
            if decoder:
                stats.offload = decoder.stats()
        finally:   # also when the caller stops reading: the next request finds these chunks stored
            if decoder:
                decoder.close()
            if self.fill_misses and blended.missed:
                blender.store_missed(tokens, blended.missed, stats)

    def _decode(self, stream: "GenerationStream", step: Callable[[int, int], torch.Tensor], position: int,
                next_id: int, generator,
                gen: GenerationConfig, stats: GenerationStats, start: float,
                first_logits: torch.Tensor | None) -> Iterator[str]:
        out_ids: list[int] = []
        buffer = StopTextBuffer(self.tokenizer, gen.stop)
        finish = "length"
        while True:
            if next_id in self._eos_ids:
                finish = "stop"
                break
            out_ids.append(next_id)
            piece, hit_stop = buffer.push(next_id)
            if piece:
                yield piece
            if hit_stop:
                finish = "stop"
                break
            if len(out_ids) >= gen.max_new_tokens:
                break
            with torch.inference_mode():
                step_logits = step(next_id, position)
            position += 1
            next_id = sample(step_logits, gen.temperature, gen.top_p, generator)
        tail = buffer.flush()
        if tail:
            yield tail
        stats.generated_tokens = len(out_ids)
        stats.total_s = time.perf_counter() - start
        stream.output = GenerationOutput(buffer.text, out_ids, stats, finish, first_logits)

    def _check_gate(self) -> None:
        """The correctness gate (``gate.py``) for this model and store: read from the store, else run now."""
        from . import gate

        verdict = gate.run(self.blender, self.tokenizer, "torch", self.name)
        self.load_stats.gate_s, self.load_stats.gate_from_store = verdict.seconds, verdict.from_store
        self.load_stats.gate_methods, self.load_stats.gate_failed = len(gate.CHECKED), verdict.failed
        if verdict.failed:
            warnings.warn(verdict.warning(self.name), stacklevel=3)

    def _warm_up(self) -> None:
        """The built-in prompt through the default method (and the draft's, with a draft): first-call kernel
        set-up and lazy imports happen here, not in a request."""
        from .gate import probe

        t = time.perf_counter()
        run = probe(self.blender, self.tokenizer)
        with torch.inference_mode():
            for method in ("full", ReuseConfig().method) + (("speccache",) if self.draft is not self.target else ()):
                run(method, ReuseConfig().recompute_ratio)
        self.load_stats.warmup_s = time.perf_counter() - t

    def _eos_token_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(self.target, "generation_config", None), "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return {i for i in ids if i is not None}

    def close(self) -> None:
        self.store.close()
