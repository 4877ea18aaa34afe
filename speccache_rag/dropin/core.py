"""What LangChain's ``ChatSpecCache`` and LlamaIndex's ``SpecCacheLLM`` are beneath their framework's API.

Both are pydantic models of their framework, with the fields they share declared once (``fields.py``).
Each reads its fields into a ``DropInSettings`` at every use, so the defaults and checks are this
module's, and keeps one ``DropIn``: the engine and every call. The settings are passed to each call
rather than kept in the ``DropIn``, because a model's fields may change after construction and its
copies share the ``DropIn`` (and so the one engine).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, fields, replace
from typing import Any

from ..config import DEFAULT_STORE, DEFAULT_TARGET, GenerationConfig, OffloadConfig, ReuseConfig
from ..engines import open_engine
from ..kv import check_salt
from ..matching import chunk_index
from ..wire import OPENAI_PARAMS
from ..output import GenerationOutput, GenerationStats
from .generate import agenerate_text, astream_text, generate_text, stream_text

PER_CALL = ("max_new_tokens", "method", "recompute_ratio", "offload", "temperature", "top_p", "stop", "seed",
            "cache_salt")

Prompt = str | Sequence[dict]       # a completion prompt, or {"role", "content"} messages


@dataclass(frozen=True)
class DropInSettings:
    """What a user sets on a drop-in, checked when built: on construction, and with each call's kwargs."""

    target: str | None = DEFAULT_TARGET     # remote mode: the served model's name (None: the server's first)
    draft: str | None = None                # None: the target scores its own tokens
    store: Any = DEFAULT_STORE              # remote mode: None, or the server's store to read its text index
    backend: str | None = None              # None: "remote" with a base_url, else "torch"
    dtype: str = "auto"
    device: str | None = None               # None: CUDA where there is one, else the CPU (torch backend)
    method: str = ReuseConfig.method
    recompute_ratio: float | str = ReuseConfig.recompute_ratio
    offload: str | OffloadConfig | None = None
    max_new_tokens: int = GenerationConfig.max_new_tokens
    temperature: float = GenerationConfig.temperature
    top_p: float = GenerationConfig.top_p
    stop: list[str] | None = None
    seed: int | None = None
    base_url: str | None = None
    api_key: str | None = None
    timeout: float | None = None            # None: the remote engine's own default, kept in one place
    max_retries: int | None = None
    cache_salt: str | None = None           # the tenant: chunks are shared within a salt, never across

    def __post_init__(self):
        ReuseConfig(method=self.method, recompute_ratio=self.recompute_ratio)
        GenerationConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)
        if OffloadConfig.parse(self.offload) is not None and self.remote:
            raise ValueError("offloaded decoding runs in-process only; remote mode (base_url) cannot use it")
        check_salt(self.cache_salt)
        if (self.timeout is not None and self.timeout <= 0) or (self.max_retries is not None and self.max_retries < 0):
            raise ValueError(f"need timeout > 0 and max_retries >= 0, got {self.timeout} and {self.max_retries}")

    @classmethod
    def of(cls, model: Any, **renamed: str) -> DropInSettings:
        """A framework model's settings, read from its fields of the same names (``renamed``: setting → field)."""
        return cls(**{f.name: getattr(model, renamed.get(f.name, f.name)) for f in fields(cls)})

    @property
    def remote(self) -> bool:
        return bool(self.base_url)

    def open_engine(self) -> Any:
        limits = {"timeout": self.timeout, "max_retries": self.max_retries}
        return open_engine(self.target, draft=self.draft, store=self.store, backend=self.backend, dtype=self.dtype,
                           device=self.device, base_url=self.base_url, api_key=self.api_key,
                           cache_salt=self.cache_salt if self.remote else None,
                           **{k: v for k, v in limits.items() if v is not None})

    def generate_kwargs(self, **call: Any) -> dict:
        """``engine.generate``'s keyword arguments: these settings under a call's own kwargs (``max_tokens``
        read as ``max_new_tokens``; None keeps the setting), checked alike."""
        unknown = set(call) - set(PER_CALL) - set(OPENAI_PARAMS) - {"max_tokens", "model"}
        if unknown:
            raise ValueError(f"unsupported argument(s) {', '.join(sorted(unknown))}: a call may set "
                             f"{', '.join(PER_CALL)}, max_tokens or model, and in remote mode {', '.join(OPENAI_PARAMS)}")
        server = {k: call[k] for k in OPENAI_PARAMS if call.get(k) is not None}
        if server and not self.remote:
            raise needs_server(", ".join(server))
        if call.get("model") not in (None, self.target):
            raise ValueError(f"a drop-in serves the one model it loaded ({self.target!r}); build another with "
                             f"target={call['model']!r} instead")
        call.setdefault("max_new_tokens", call.get("max_tokens"))
        s = replace(self, **{k: v for k, v in call.items() if k in PER_CALL and v is not None})
        return dict(max_new_tokens=s.max_new_tokens, reuse=ReuseConfig(method=s.method, recompute_ratio=s.recompute_ratio),
                    offload=OffloadConfig.parse(s.offload), temperature=s.temperature, top_p=s.top_p, stop=s.stop,
                    seed=s.seed, **({"openai_params": server} if server else {}),
                    **({"cache_salt": s.cache_salt} if s.cache_salt else {}))


def needs_server(what: str) -> ValueError:
    """The error for tools, structured output and function calling asked of the in-process engine."""
    return ValueError(f"{what}: needs a SpecCache vLLM server (base_url=…, served with --enable-auto-tool-choice "
                      "--tool-call-parser …); the in-process engine has no tool-call parser or guided decoding")


def init_arguments(kwargs: dict, engine: Any = None) -> dict:
    """A drop-in's constructor arguments, ``model`` read as ``target``, with the defaults the others imply:
    a given engine's name and store; in remote mode no target (the server's first model) and no store (the
    server has it; give one to read its chunk-text index)."""
    kwargs = dict(kwargs)
    if "api_base" in kwargs and "base_url" not in kwargs:        # OpenAILike's name for it
        kwargs["base_url"] = kwargs.pop("api_base")
    if "model" in kwargs:
        kwargs["target"] = kwargs.pop("model")
    if engine is not None:
        implied = {"target": engine.name, "store": engine.store}
    else:
        implied = {"target": None, "store": None} if kwargs.get("base_url") else {}
    return {**implied, **kwargs}


def store_name(store: Any) -> str | None:
    """A store setting as it serializes: its spec, or the class of a store object."""
    return store if isinstance(store, str) or store is None else type(store).__name__


def usage(out: GenerationOutput) -> dict:
    """The OpenAI usage block the frameworks' token counting reads: a remote server's own, else one made
    from the statistics, with the reused tokens as cached tokens."""
    s = out.stats
    return out.usage or {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generated_tokens,
                         "total_tokens": s.prompt_tokens + s.generated_tokens,
                         "prompt_tokens_details": {"cached_tokens": s.reused_tokens}}


def cached_tokens(out: GenerationOutput) -> int:
    """The prompt tokens a generation reused, as a remote server counted them where it did."""
    return (usage(out).get("prompt_tokens_details") or {}).get("cached_tokens", out.stats.reused_tokens)


class DropIn:
    """A drop-in's engine, opened from its settings on first use, and the calls both frameworks make."""

    def __init__(self, engine: Any = None):
        self._engine = engine
        self._lock = threading.Lock()
        self._last = threading.local()      # per thread, so that concurrent callers each see their own call's stats

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    def engine(self, settings: DropInSettings) -> Any:
        with self._lock:
            if self._engine is None:
                self._engine = settings.open_engine()
            return self._engine

    async def aengine(self, settings: DropInSettings) -> Any:
        """``engine``, opened in a worker thread on first use so that the event loop keeps running."""
        return self._engine or await asyncio.to_thread(self.engine, settings)

    @property
    def last_stats(self) -> GenerationStats | None:
        """Statistics of the most recent call made from this thread."""
        return getattr(self._last, "stats", None)

    def _record(self, item: str | GenerationOutput) -> str | GenerationOutput:
        if isinstance(item, GenerationOutput):
            self._last.stats = item.stats
        return item

    def generate(self, settings: DropInSettings, prompt: Prompt, hints: list[str] | None = None,
                 **call: Any) -> GenerationOutput:
        """One whole generation; ``call``: the framework's per-call kwargs."""
        kwargs = settings.generate_kwargs(**call)
        return self._record(generate_text(self.engine(settings), prompt, hints, **kwargs))

    async def agenerate(self, settings: DropInSettings, prompt: Prompt, hints: list[str] | None = None,
                        **call: Any) -> GenerationOutput:
        kwargs = settings.generate_kwargs(**call)
        return self._record(await agenerate_text(await self.aengine(settings), prompt, hints, **kwargs))

    def stream(self, settings: DropInSettings, prompt: Prompt, hints: list[str] | None = None,
               **call: Any) -> Iterator[str | GenerationOutput]:
        """Text pieces as they are decoded, then the call's ``GenerationOutput``."""
        kwargs = settings.generate_kwargs(**call)
        for item in stream_text(self.engine(settings), prompt, hints, **kwargs):
            yield self._record(item)

    async def astream(self, settings: DropInSettings, prompt: Prompt, hints: list[str] | None = None,
                      **call: Any) -> AsyncIterator[str | GenerationOutput]:
        kwargs = settings.generate_kwargs(**call)
        # closed with this stream, so that a framework that stops reading stops generation at the next token
        async with aclosing(astream_text(await self.aengine(settings), prompt, hints, **kwargs)) as items:
            async for item in items:
                yield self._record(item)

    def precompute(self, settings: DropInSettings, texts: list[str], progress: bool = False, engine: Any = None,
                   embeddings: Any = None, neighbors: int = 0) -> list[str]:
        """``precompute_texts`` with the drop-in's engine; → the keys. In remote mode ``engine`` may be a local
        engine writing into the store the server reads: refused (``ValueError``) unless the server would
        read its KV, and the keys are taught to the remote engine, which sends them with queries."""
        if engine is None:
            return precompute_texts(self.engine(settings), texts, progress, embeddings, neighbors, settings.cache_salt)
        if not settings.remote:
            raise ValueError("precompute(engine=...) is for remote mode; a local drop-in has its own engine")
        server = self.engine(settings)
        server.check_engine(engine)
        keys = precompute_texts(engine, texts, progress, embeddings, neighbors, settings.cache_salt)
        chunk_index(server).add([t.strip() for t in texts], keys)
        return keys


def precompute_texts(engine: Any, texts: Iterable[str], progress: bool = False, embeddings: Any = None,
                     neighbors: int = 0, cache_salt: str | None = None) -> list[str]:
    """``engine.precompute`` of the stripped texts, remembered for matching; → their keys.

    neighbors > 0: each text is also stored prefilled after its ``neighbors`` nearest texts of this batch by
    ``embeddings`` (one vector per text, as the framework's ingestion made them): ``neighbors.py``."""
    texts = [t.strip() for t in texts]
    context = None
    if neighbors:
        context = neighbour_texts(texts, embeddings, neighbors)
        if not hasattr(engine, "blender"):
            raise ValueError("ingestion-time neighbours are computed by the torch engine: precompute with a local "
                             "engine (remote mode: precompute(..., engine=SpecCacheEngine.from_pretrained(...)))")
    keys = engine.precompute(texts, progress=progress, **({"context": context} if context else {}),
                             **({"cache_salt": cache_salt} if cache_salt else {}))
    chunk_index(engine).add(texts, keys)
    return keys


def neighbour_texts(texts: list[str], embeddings: Any, k: int) -> list[list[str]]:
    """For each text, its ``k`` nearest other texts by ``embeddings`` (duplicates of itself left out)."""
    from ..neighbors import nearest

    if embeddings is None or len(embeddings) != len(texts):
        raise ValueError(f"neighbors={k} needs one embedding per text ({len(texts)}), got "
                         f"{'none' if embeddings is None else len(embeddings)}")
    return [[texts[j] for j in near if texts[j] != texts[i]] for i, near in enumerate(nearest(embeddings, k))]
