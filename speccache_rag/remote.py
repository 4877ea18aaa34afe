"""``RemoteEngine``: the engine API (precompute / generate / stream, sync and async) over a SpecCache
``vllm serve``, through the official ``openai`` client. No model is loaded in this process.

What crosses the wire, in ``extra_body={"kv_transfer_params": {"speccache": {...}}}`` (the connector's
per-request parameters, :mod:`speccache_rag.vllm.connector`):

* a query sends the chat messages as any OpenAI client would, plus ``chunks``: the store keys of the
  chunks found in them (learned from precompute, or from a shared store's text index). The server
  places each stored chunk where its tokens are and ignores, with a warning in its log and in the
  response, a key that is unknown, another model's, or not in the prompt.
* precompute asks ``op="info"`` for the server's model fingerprint and sink tokens, tokenizes each
  chunk with the server's ``/tokenize``, and sends the chunks the store lacks as one-token requests
  ``[sink] + chunk + one token`` flagged ``op="precompute"`` — the KV comes from the very weights
  that serve it, under the key any engine of that model computes.

Reused tokens come back as ``usage.prompt_tokens_details.cached_tokens`` (the server needs
``--enable-prompt-tokens-details``) and, for a non-streamed response, every statistic of the blend
in the response's ``kv_transfer_params``.
"""
from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .config import ReuseConfig
from .kv import check_salt, chunk_key, tenant_fingerprint
from .matching import chunk_index
from .contract import Engine, chunk_texts
from .output import GenerationOutput, GenerationStream
from .prompt import RAGPrompt
from .remote_output import Accumulator, finish_reason, plain_usage, stats_from
from . import wire

logger = logging.getLogger("speccache_rag.remote")
INSTALL_HINT = "remote mode needs the OpenAI client: pip install 'speccache-rag[remote]'"
PRECOMPUTE_IN_FLIGHT = 8        # one-token precompute requests sent at once (the server batches them)


def _openai():
    try:
        import openai
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(INSTALL_HINT) from e
    return openai


@dataclass
class PrecomputeSummary:
    """What one ``RemoteEngine.precompute`` did."""

    chunks: int = 0                  # distinct chunks asked for
    new: int = 0                     # computed and stored by the server now
    already_stored: int = 0
    failed: list[str] = field(default_factory=list)     # keys the store still lacks afterwards

    def line(self) -> str:
        return (f"{self.chunks} chunks: {self.new} new, {self.already_stored} already stored, "
                f"{len(self.failed)} failed")


class ServerUnavailable(ConnectionError):
    """The SpecCache server cannot be reached (or stopped answering)."""


class RemoteEngine(Engine):
    """A SpecCache ``vllm serve`` at ``base_url`` (``http://host:8000/v1``), as an engine.

    ``model``: the served model name (None: the server's first); ``store``: optional, the server's
    shared store (e.g. ``redis://…``) — its chunk-text index lets this client find chunks that other
    processes precomputed. Everything else a query needs, the server has.
    """

    backend = "remote"
    offload_note = ("offloaded decoding runs in-process only (backend='torch'); the server decodes with vLLM's own "
                    "attention (docs/vllm.md)")

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, store=None,
                 timeout: float = 600.0, max_retries: int = 2, cache_salt: str | None = None):
        """``cache_salt``: this client's tenant — sent with every request (vLLM's own field), so that its
        chunks are shared with requests of the same salt only; a call's ``cache_salt=`` overrides it."""
        self.cache_salt = check_salt(cache_salt)
        openai = _openai()
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL such as http://localhost:8000/v1, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        # openai's own Timeout: the HTTP library under it changes between releases (httpx, then httpx2)
        http_timeout = openai.Timeout(timeout, connect=min(10.0, timeout))
        kw = dict(base_url=self.base_url, api_key=api_key or "EMPTY", timeout=http_timeout, max_retries=max_retries)
        self.client = openai.OpenAI(**kw)
        self._client_kw = kw
        # an async client's connections belong to one event loop (asyncio.run makes a new one each time)
        self._aclients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if isinstance(store, str):
            from .store import open_store

            store = open_store(store)
        self.store = store
        self._model = model
        self._card: dict | None = None
        self._info: dict | None = None
        self.last_precompute: PrecomputeSummary | None = None

    # ---- what the server is ----------------------------------------------------------------------
    def _unreachable(self, e: Exception) -> ServerUnavailable:
        return ServerUnavailable(f"the SpecCache server at {self.base_url} is unreachable ({e}); "
                                 "is `vllm serve` running there? (docs/deploy.md)")

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _openai().APIConnectionError as e:       # timeouts included
            raise self._unreachable(e) from e

    async def _acall(self, coro):
        try:
            return await coro
        except _openai().APIConnectionError as e:
            raise self._unreachable(e) from e

    def _aclient(self):
        loop = asyncio.get_running_loop()
        if loop not in self._aclients:
            self._aclients[loop] = _openai().AsyncOpenAI(**self._client_kw)
        return self._aclients[loop]

    def _model_card(self) -> dict:
        if self._card is None:
            cards = [m.model_dump() for m in self._call(self.client.models.list).data]
            if not cards:
                raise RuntimeError(f"the server at {self.base_url} serves no model")
            if self._model is None:
                self._card = cards[0]
            else:
                match = [c for c in cards if c["id"] == self._model]
                if not match:
                    raise ValueError(f"the server at {self.base_url} does not serve {self._model!r}; "
                                     f"it serves {', '.join(c['id'] for c in cards)}")
                self._card = match[0]
        return self._card

    @property
    def name(self) -> str:
        return self._model or self._model_card()["id"]

    @property
    def context_window(self) -> int:
        return int(self._model_card().get("max_model_len") or 2048)

    def _tenant(self, cache_salt: str | None) -> str | None:
        """A call's salt, else this client's."""
        return cache_salt or self.cache_salt

    @staticmethod
    def _salted(extra: dict, salt: str | None) -> dict:
        return {**extra, "cache_salt": salt} if salt else extra

    def info(self, keys: Iterable[str] = (), cache_salt: str | None = None) -> dict:
        """The server's SpecCache facts (fingerprint, sink_ids, dtype, defaults); ``keys``: → ``stored``,
        those of them its store holds. Raises if the server does not run the SpecCache connector."""
        keys = list(keys)
        resp = self._call(self.client.completions.create, model=self.name, prompt="info", max_tokens=1,
                          temperature=0.0, extra_body=self._salted(wire.wrap(wire.info(keys)), self._tenant(cache_salt)))
        info = wire.read((resp.model_extra or {}).get("kv_transfer_params")) or None
        if info and "error" in info:
            raise RuntimeError(f"the SpecCache connector at {self.base_url} could not answer: {info['error']}")
        if not info or "fingerprint" not in info:
            raise RuntimeError(f"the server at {self.base_url} does not run the SpecCache KV connector "
                               "(start it with --kv-transfer-config; docs/deploy.md)")
        if info.get("unsupported"):
            logger.warning("SpecCache server at %s cannot blend: %s", self.base_url, info["unsupported"])
        if not keys:
            self._info = info
        return info

    def _facts(self) -> dict:
        """``info()`` without keys, asked once."""
        return self._info if self._info is not None else self.info()

    @property
    def fingerprint(self) -> str:
        return self._facts()["fingerprint"]

    def check_engine(self, engine) -> None:
        """Refuse a local engine whose KV the server would never read (another model, dtype or sink)."""
        if engine.fingerprint != self.fingerprint:
            raise ValueError(
                f"{getattr(engine, 'name', 'this engine')} computes KV under model fingerprint "
                f"{engine.fingerprint[:12]}…, the server at {self.base_url} under {self.fingerprint[:12]}… "
                "(another model, dtype or sink policy): the server would never read it. Precompute with the "
                "server's weights, dtype and sink, or through the server (precompute on the remote LLM).")

    def tokenize(self, text: str) -> list[int]:
        """The server tokenizer's ids for one piece of text (no special tokens), as chunks are stored."""
        # /tokenize sits beside /v1; the client's post takes the absolute URL with its auth and timeout
        body = {"model": self.name, "prompt": text, "add_special_tokens": False}
        return list(self._call(self.client.post, f"{self._root}/tokenize", cast_to=object, body=body)["tokens"])

    # ---- ingestion ---------------------------------------------------------------------------------
    def precompute(self, texts: Iterable[str], progress: bool = False, cache_salt: str | None = None) -> list[str]:
        """Have the server compute and store each chunk's KV (idempotent); → the chunks' keys.
        ``last_precompute`` says how many were new, already stored, or failed. ``cache_salt``: the tenant
        (default: this client's)."""
        from tqdm.auto import tqdm

        texts = chunk_texts(texts)
        sink = self._facts()["sink_ids"]
        with ThreadPoolExecutor(PRECOMPUTE_IN_FLIGHT) as pool:
            ids_of = list(pool.map(self.tokenize, texts))
        for ids in ids_of:
            self.check_chunk_fits(len(ids), len(sink))
        salt = self._tenant(cache_salt)
        keys = [chunk_key(tenant_fingerprint(self.fingerprint, salt), ids) for ids in ids_of]
        todo = dict(zip(keys, ids_of))
        stored = set(self.info(list(todo), salt)["stored"])
        summary = PrecomputeSummary(chunks=len(todo), already_stored=len(stored))
        todo = {k: ids for k, ids in todo.items() if k not in stored}

        def one(ids: list[int]) -> None:
            params = wire.precompute(len(sink), len(sink) + len(ids), wire.new_tag())
            self._call(self.client.completions.create, model=self.name, prompt=sink + ids + ids[-1:], max_tokens=1,
                       temperature=0.0, extra_body=self._salted(wire.wrap(params), salt))

        with tqdm(total=len(todo), desc="precompute KV (server)", unit="chunk", disable=not progress) as bar, \
                ThreadPoolExecutor(PRECOMPUTE_IN_FLIGHT) as pool:
            for fut in [pool.submit(one, ids) for ids in todo.values()]:
                try:
                    fut.result()
                except (ServerUnavailable, _openai().PermissionDeniedError):    # down, or refused by policy
                    raise
                except Exception as e:     # counted below (the store is the judge), the rest go on
                    logger.warning("SpecCache: a precompute request failed: %s", e)
                bar.update(1)
        now = set(self.info(list(todo), salt)["stored"]) if todo else set()
        summary.new, summary.failed = len(now), [k for k in todo if k not in now]
        self.last_precompute = summary
        logger.info("SpecCache precompute on %s: %s", self.base_url, summary.line())
        if summary.failed:
            logger.warning("SpecCache: %d chunk(s) were not stored by the server; see its log for 'SpecCache:' "
                           "warnings", len(summary.failed))
        return keys

    # ---- queries -----------------------------------------------------------------------------------
    def _request(self, prompt: RAGPrompt, max_new_tokens: int, reuse: ReuseConfig | None, temperature: float,
                 top_p: float, stop, seed, return_first_logits: bool, offload,
                 openai_params: dict | None = None, cache_salt: str | None = None) -> tuple[dict, str]:
        req = self.request(prompt, max_new_tokens, reuse, temperature, top_p, stop, seed, return_first_logits, offload,
                           cache_salt)
        if return_first_logits:
            raise ValueError("first-token logits are not available from a remote server")
        salt = self._tenant(cache_salt)
        # the text index knows unsalted keys; a tenant's chunks the server finds by content in that tenant's store
        keys = None if salt else [k for t in req.prompt.chunks for k in chunk_index(self).keys(t)]
        gen = req.gen
        body = dict(model=self.name, messages=req.prompt.messages(req.prompt.chunks), max_tokens=gen.max_new_tokens,
                    temperature=gen.temperature, top_p=gen.top_p, stop=list(gen.stop) or None, seed=gen.seed,
                    extra_body=self._salted(wire.wrap(wire.query(req.reuse, wire.new_tag(), chunks=keys)), salt))
        unknown = set(openai_params or ()) - set(wire.OPENAI_PARAMS)
        if unknown:
            raise ValueError(f"unsupported request field(s) {', '.join(sorted(unknown))}: the server is sent "
                             f"{', '.join(wire.OPENAI_PARAMS)}")
        body.update({k: v for k, v in (openai_params or {}).items() if v is not None})
        return body, (req.reuse.method if req.reuse is not None else self._default_method())

    def _default_method(self) -> str:
        return (self._info or {}).get("method", "server default")

    def generate(self, prompt: RAGPrompt, max_new_tokens: int = 64, reuse: ReuseConfig | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, stop=None, seed: int | None = None,
                 return_first_logits: bool = False, offload=None, openai_params: dict | None = None,
                 cache_salt: str | None = None) -> GenerationOutput:
        """One non-streamed request: the response carries every statistic of the blend. ``openai_params``: the
        ``wire.OPENAI_PARAMS`` fields (tools, response_format, …), sent as they are."""
        body, method = self._request(prompt, max_new_tokens, reuse, temperature, top_p, stop, seed,
                                     return_first_logits, offload, openai_params, cache_salt)
        start = time.perf_counter()
        resp = self._call(self.client.chat.completions.create, **body)
        return self._output(resp, method, start)

    async def agenerate(self, prompt: RAGPrompt, max_new_tokens: int = 64, reuse: ReuseConfig | None = None,
                        temperature: float = 0.0, top_p: float = 1.0, stop=None, seed: int | None = None,
                        offload=None, openai_params: dict | None = None,
                        cache_salt: str | None = None) -> GenerationOutput:
        body, method = self._request(prompt, max_new_tokens, reuse, temperature, top_p, stop, seed, False, offload,
                                     openai_params, cache_salt)
        start = time.perf_counter()
        resp = await self._acall(self._aclient().chat.completions.create(**body))
        return self._output(resp, method, start)

    def _output(self, resp, method: str, start: float) -> GenerationOutput:
        elapsed = time.perf_counter() - start
        choice = resp.choices[0]
        report = wire.read((resp.model_extra or {}).get("kv_transfer_params"))
        for item in report.get("ignored", ()):
            logger.warning("SpecCache server ignored chunk id %s: %s", str(item.get("key"))[:16], item.get("reason"))
            chunk_index(self).forget(str(item.get("key")))       # not sent again
        stats = stats_from(method, resp.usage, report, elapsed, elapsed)
        calls = [c.model_dump(exclude_none=True) for c in choice.message.tool_calls or ()]
        return GenerationOutput(choice.message.content or "", [], stats, finish_reason(choice.finish_reason),
                                usage=plain_usage(resp.usage), tool_calls=calls or None)

    def stream(self, prompt: RAGPrompt, max_new_tokens: int = 64, reuse: ReuseConfig | None = None,
               temperature: float = 0.0, top_p: float = 1.0, stop=None, seed: int | None = None,
               return_first_logits: bool = False, offload=None, openai_params: dict | None = None,
               cache_salt: str | None = None) -> GenerationStream:
        """Text pieces as the server sends them; ``.output`` (usage-based statistics, tool calls) once done."""
        body, method = self._request(prompt, max_new_tokens, reuse, temperature, top_p, stop, seed,
                                     return_first_logits, offload, openai_params, cache_salt)
        stream = GenerationStream()
        stream._pieces = self._pieces(stream, body, method)
        return stream

    def _pieces(self, stream: GenerationStream, body: dict, method: str) -> Iterator[str]:
        start = time.perf_counter()
        events = self._call(self.client.chat.completions.create, stream=True,
                            stream_options={"include_usage": True}, **body)
        acc = Accumulator(method, start)
        try:
            for event in events:
                piece = acc.add(event)
                if piece:
                    yield piece
        finally:
            events.close()
        stream.output = acc.output()

    async def astream(self, prompt: RAGPrompt, max_new_tokens: int = 64, reuse: ReuseConfig | None = None,
                      temperature: float = 0.0, top_p: float = 1.0, stop=None, seed: int | None = None,
                      offload=None, openai_params: dict | None = None,
                      cache_salt: str | None = None) -> AsyncIterator[str | GenerationOutput]:
        """Async text pieces, then this call's ``GenerationOutput`` (as ``dropin.astream_text``)."""
        body, method = self._request(prompt, max_new_tokens, reuse, temperature, top_p, stop, seed, False, offload,
                                     openai_params, cache_salt)
        start = time.perf_counter()
        events = await self._acall(self._aclient().chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **body))
        acc = Accumulator(method, start)
        try:
            async for event in events:
                piece = acc.add(event)
                if piece:
                    yield piece
        finally:
            await events.close()
        yield acc.output()

    def close(self) -> None:
        self.client.close()


__all__ = ["RemoteEngine", "PrecomputeSummary", "ServerUnavailable"]
