"""``VllmSpecCacheEngine``: the torch engine's API (precompute / generate / generate_many / stream) on vLLM.

``SpecCacheEngine.from_pretrained(..., backend="vllm")`` returns one. vLLM runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the scheduler, the worker with the SpecCache connector and
this client share the KV store object and the per-request statistics. Every request carries its
chunk spans and the RAGPrompt in ``kv_transfer_params``, so the connector needs no content lookup
and the draft reads the prompt exactly as the torch engine's draft does (same selection).

Chunk KV is computed by vLLM itself (a one-token request per chunk whose prompt is the sink and the
chunk), under the same fingerprint and key as the torch engine's: either backend reads what the
other stored.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..config import DEFAULT_STORE, ReuseConfig
from ..contract import Engine, Request, check_sink, chunk_texts
from ..output import GenerationOutput, GenerationStats, GenerationStream
from ..hardware import dtype_name
from ..kv import chunk_key, tenant_fingerprint
from ..prompt import RAGPrompt, render, sink_token_ids, tokenize_piece
from ..store import KVStore
from .. import wire
from . import kv_transfer_config, require_vllm
from .lookup import fingerprint_for, shared_store


@dataclass
class _Pending:
    request_id: str
    tag: str
    method: str
    prompt_tokens: int
    start: float
    want_logits: bool = False
    ttft_s: float | None = None
    total_s: float = 0.0
    text: str = ""
    output: object = None
    finished: bool = False
    events: queue.Queue | None = None    # (request, new text | exception, finished), fed by the driver thread


class VllmSpecCacheEngine(Engine):
    """SpecCache on vLLM, in process. Build it with ``SpecCacheEngine.from_pretrained(..., backend="vllm")``."""

    backend = "vllm"
    offload_note = ("offloaded decoding runs on the torch engine only (backend='torch'): vLLM's scheduler has no "
                    "two-token speculative step and no low-bit decode attention (docs/vllm.md)")

    def __init__(self, target: str, draft: str | None = None, store: KVStore | str = DEFAULT_STORE,
                 dtype: torch.dtype | str = "auto", sink: str = "bos", fill_misses: bool = True,
                 method: str = ReuseConfig.method, recompute_ratio: float | str = ReuseConfig.recompute_ratio, max_model_len: int | None = None,
                 kv_cache_gib: int | None = None, enforce_eager: bool = True, name: str | None = None,
                 connector_options: dict | None = None, **engine_kwargs):
        require_vllm()
        from transformers import AutoConfig
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from ..models import load_tokenizer, resolve

        check_sink(sink)
        self.model_dir = resolve(target)
        self.name = name or str(target)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.store, store_url = shared_store(store)
        self.sink = sink
        self.dtype = dtype_name(dtype)
        self.fingerprint = fingerprint_for(str(self.model_dir), self.dtype, sink)
        self._sink_ids = sink_token_ids(self.tokenizer, sink)
        config = AutoConfig.from_pretrained(str(self.model_dir))
        self.context_window = int(max_model_len or min(config.max_position_embeddings, 8192))
        draft_dir = None if draft in (None, target) else str(resolve(draft))
        ktc = kv_transfer_config(store_url, draft_dir, method, recompute_ratio, sink=sink, fill_misses=fill_misses,
                                 **(connector_options or {}))
        args = EngineArgs(model=str(self.model_dir), dtype=self.dtype, max_model_len=self.context_window,
                          enforce_eager=enforce_eager, enable_prefix_caching=True, max_logprobs=-1,
                          kv_transfer_config=KVTransferConfig(**ktc), **engine_kwargs)
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if kv_cache_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self.engine = LLMEngine.from_engine_args(args)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._defaults = (method, recompute_ratio)
        self._inflight: dict[str, _Pending] = {}
        # LLMEngine is not thread-safe: one driver thread steps it; callers add and abort under this lock
        # (reentrant, so a batch is added under one hold) and wait on their own requests' queues.
        self._lock = threading.Condition(threading.RLock())
        self._closing = False
        self._driver = threading.Thread(target=self._drive_engine, name="speccache-vllm-driver", daemon=True)
        self._driver.start()

    # ---- ingestion ------------------------------------------------------------------------------
    def precompute(self, texts: Iterable[str], progress: bool = False, cache_salt: str | None = None) -> list[str]:
        """Compute and store the KV of each chunk text through vLLM (idempotent); returns their keys.
        ``cache_salt``: the tenant they are stored for (the connector keys them under it)."""
        from tqdm.auto import tqdm
        from vllm import SamplingParams

        keys, todo = [], {}
        for text in chunk_texts(texts):
            ids, _ = tokenize_piece(self.tokenizer, text)
            self.check_chunk_fits(len(ids), len(self._sink_ids))
            key = chunk_key(tenant_fingerprint(self.fingerprint, cache_salt), ids)
            keys.append(key)
            if key not in todo and not self.store.contains(key):
                todo[key] = ids
        bar = tqdm(total=len(todo), desc="precompute KV (vLLM)", unit="chunk", disable=not progress)
        pending, events = [], queue.Queue()
        for key, ids in todo.items():
            s = len(self._sink_ids)
            params = wire.precompute(s, s + len(ids), wire.new_tag())
            sp = SamplingParams(max_tokens=1, temperature=0.0, extra_args=wire.wrap(params))
            prompt = {"prompt_token_ids": self._sink_ids + ids + ids[-1:],
                      **({"cache_salt": cache_salt} if cache_salt else {})}
            pending.append(self._add(prompt, sp, params["tag"], "precompute", len(prompt["prompt_token_ids"]),
                                     events=events))
        for p, _ in self._drive(pending):
            if p.output is not None and p.output.finished:
                bar.update(1)
        bar.close()
        missing = [k for k in todo if not self.store.contains(k)]
        if missing:
            raise RuntimeError(f"{len(missing)} chunk(s) were not stored by the vLLM worker; see the log "
                               "for 'SpecCache:' warnings (unsupported model, or the plugin is not installed)")
        return keys

    # ---- query ----------------------------------------------------------------------------------
    def stream(self, prompt: RAGPrompt, max_new_tokens: int = 64, reuse: ReuseConfig | None = None,
               temperature: float = 0.0, top_p: float = 1.0, stop: Iterable[str] | str | None = None,
               seed: int | None = None, return_first_logits: bool = False, offload=None,
               cache_salt: str | None = None) -> GenerationStream:
        """An iterator of this request's text pieces; its ``.output`` holds the result once it is done.
        ``cache_salt``: vLLM's request field, and the tenant whose chunks alone the request reuses."""
        req = self.request(prompt, max_new_tokens, reuse, temperature, top_p, stop, seed, return_first_logits, offload,
                           cache_salt)
        pending = self._submit(req)
        stream = GenerationStream()
        stream._pieces = self._pieces(stream, pending)
        return stream

    def _pieces(self, stream: GenerationStream, pending: _Pending) -> Iterator[str]:
        try:
            for _, piece in self._drive([pending]):
                if piece:
                    yield piece
        finally:
            with self._lock:                         # still in flight: the caller stopped reading early
                if self._inflight.pop(pending.request_id, None) is not None and self.engine is not None:
                    self.engine.abort_request([pending.request_id])
        stream.output = self._result(pending)

    def generate_many(self, prompts: list[RAGPrompt], max_new_tokens: int = 64, reuse: ReuseConfig | None = None,
                      temperature: float = 0.0, top_p: float = 1.0, stop: Iterable[str] | str | None = None,
                      seed: int | None = None, cache_salt: str | None = None,
                      salt_per_request: bool = False) -> list[GenerationOutput]:
        """Submit every prompt at once (vLLM batches them, blends included) and wait for all.

        ``cache_salt``: vLLM's request field — it keeps these requests from hitting (exact) prefix-cache blocks
        of requests with another salt, and is the tenant whose chunks alone they reuse. ``salt_per_request``:
        each request gets its own salt (``cache_salt:tag``): full prefill computed cold, for benchmarks (each
        request is then a tenant of its own, so a blend finds no chunks).
        """
        events: queue.Queue = queue.Queue()
        with self._lock:                    # all submitted before the driver's next step: they blend together
            pending = [self._submit(self.request(p, max_new_tokens, reuse, temperature, top_p, stop, seed,
                                                 cache_salt=cache_salt), salt_per_request, events) for p in prompts]
        for _ in self._drive(pending):
            pass
        return [self._result(p) for p in pending]

    # ---- internals ------------------------------------------------------------------------------
    def _submit(self, req: Request, salt_per_request: bool = False,
                events: queue.Queue | None = None) -> _Pending:
        from vllm import SamplingParams

        prompt, gen, want_logits = req.prompt, req.gen, req.return_first_logits
        reuse = req.reuse or ReuseConfig(method=self._defaults[0], recompute_ratio=self._defaults[1])
        start = time.perf_counter()
        tokens = render(prompt, self.tokenizer)
        self.check_fits(len(tokens), gen.max_new_tokens)
        tag = wire.new_tag()
        params = wire.query(reuse, tag, [[s.start, s.end] for s in tokens.chunk_segments()], prompt)
        sp = SamplingParams(max_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p,
                            stop=list(gen.stop) or None, seed=gen.seed, logprobs=-1 if want_logits else None,
                            extra_args=wire.wrap(params))
        request = {"prompt_token_ids": tokens.token_ids}
        if req.cache_salt:
            request["cache_salt"] = f"{req.cache_salt}:{tag}" if salt_per_request else req.cache_salt
        return self._add(request, sp, tag, reuse.method, len(tokens), start, want_logits, events)

    def _add(self, prompt: dict, sp, tag: str, method: str, n: int, start: float | None = None,
             want_logits: bool = False, events: queue.Queue | None = None) -> _Pending:
        request_id = f"speccache-{tag}"
        p = _Pending(request_id, tag, method, n, start if start is not None else time.perf_counter(), want_logits,
                     events=events or queue.Queue())
        with self._lock:
            if self.engine is None:
                raise RuntimeError("the engine is closed")
            self.engine.add_request(request_id, prompt, sp)
            self._inflight[request_id] = p
            self._lock.notify()
        return p

    def _drive_engine(self) -> None:
        """The driver thread: step the engine while requests are in flight; hand each output to its request."""
        while True:
            with self._lock:
                while not self._inflight and not self._closing:
                    self._lock.wait()
                if self._closing:
                    return
                try:
                    if not self.engine.has_unfinished_requests():
                        raise RuntimeError(f"vLLM dropped {len(self._inflight)} request(s)")
                    outs = self.engine.step()
                except Exception as e:        # every waiting caller gets the error, none hangs
                    for p in self._inflight.values():
                        p.events.put((p, e, True))
                    self._inflight.clear()
                    continue
                now = time.perf_counter()
                for out in outs:
                    p = self._inflight.get(out.request_id)
                    if p is None:
                        continue
                    o = out.outputs[0] if out.outputs else None
                    if o is not None and p.ttft_s is None and len(o.token_ids) > 0:
                        p.ttft_s = now - p.start
                    p.output = out
                    piece = ""
                    if o is not None and len(o.text) > len(p.text):
                        piece, p.text = o.text[len(p.text):], o.text
                    if out.finished:
                        p.total_s, p.finished = now - p.start, True
                        self._inflight.pop(out.request_id, None)
                    p.events.put((p, piece, out.finished))

    def _drive(self, pending: list[_Pending]) -> Iterator[tuple[_Pending, str]]:
        """Wait for the requests in ``pending`` (sharing one events queue) to finish; yields (request, new text)."""
        waiting = {p.request_id for p in pending}
        events = pending[0].events if pending else None
        while waiting:
            p, item, finished = events.get()
            if isinstance(item, Exception):
                raise RuntimeError(f"vLLM failed while serving request {p.request_id}") from item
            if finished:
                waiting.discard(p.request_id)
            yield p, item

    def _result(self, p: _Pending) -> GenerationOutput:
        out = p.output
        o = out.outputs[0]
        report = wire.REPORTS.pop(p.tag) or wire.read(out.kv_transfer_params) or None
        # the worker's statistics of the blend; none for full prefill, or a fallback to it (vLLM computed every token)
        stats = GenerationStats.from_dict(report) if report else GenerationStats(p.method, p.prompt_tokens,
                                                                                   recomputed_tokens=p.prompt_tokens)
        stats.prompt_tokens, stats.dtype = p.prompt_tokens, self.dtype     # method: the worker's (the gate may say full)
        stats.generated_tokens, stats.ttft_s, stats.total_s = len(o.token_ids), p.ttft_s or 0.0, p.total_s
        first_logits = None
        if p.want_logits and o.logprobs:
            first = o.logprobs[0]
            first_logits = torch.full((max(len(self.tokenizer), max(first) + 1),), float("-inf"))
            for tok, lp in first.items():
                first_logits[tok] = lp.logprob
        finish = "stop" if o.finish_reason == "stop" else "length"
        result = GenerationOutput(o.text, list(o.token_ids), stats, finish, first_logits)
        result.connector_report = report      # vLLM backend extra: the worker's raw report (or None)
        return result

    def close(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            with lock:
                self._closing = True
                lock.notify_all()
            self._driver.join()
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            for target in (engine, getattr(engine, "engine_core", None)):
                shutdown = getattr(target, "shutdown", None)
                if callable(shutdown):
                    try:
                        shutdown()
                    except Exception:
                        pass
                    break
