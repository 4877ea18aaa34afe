"""``SpecCacheLLM``: a LlamaIndex LLM whose prompts reuse the KV of precomputed chunks."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Dict, List, Literal, Optional, Sequence, Union

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_serializer
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM

from llama_index.llms.speccache.hints import RetrievalHints
from speccache_rag import GenerationOutput, GenerationStats, OffloadConfig, ReuseConfig, SpecCacheEngine
from speccache_rag.config import DEFAULT_STORE
from speccache_rag.matching import agenerate_text, astream_text, generate_text, stream_text

_ROLES = {"developer": "system", "chatbot": "assistant", "model": "assistant"}


class SpecCacheLLM(LLM):
    """A local LLM that reuses the KV caches of retrieved chunks, repaired by speculative recompute.

    The prompt LlamaIndex builds is searched for chunks whose KV was precomputed (by
    ``SpecCacheKVPrecompute`` in the ingestion pipeline, or seen in an earlier prompt); those are
    loaded from the store instead of prefilled, and only the tokens a draft model marks as
    important are recomputed. Everything else about the query engine stays as it is.

    Setup:
        ``pip install 'speccache-rag[llama-index]'``

    Instantiate:
        .. code-block:: python

            from llama_index.llms.speccache import SpecCacheLLM

            llm = SpecCacheLLM(target="smollm2-135m", draft="smollm2-135m", store="./kv",
                               max_new_tokens=64, method="speccache", recompute_ratio=0.15)
            # or SpecCacheLLM(engine=SpecCacheEngine(...)) to share a loaded engine

        Construction is cheap: the model loads on the first call (or ``llm.engine``).

    Invoke:
        .. code-block:: python

            resp = llm.complete("Context: ...\\n\\nQuestion: ...")
            resp.text, resp.additional_kwargs["reused_tokens"]   # statistics of this call
            llm.last_stats                                        # GenerationStats of the last call

    Stream:
        .. code-block:: python

            for r in llm.stream_complete(prompt):
                print(r.delta, end="")
            # the last response has delta "" and carries the statistics

    In a query engine:
        .. code-block:: python

            index.as_query_engine(llm=llm).query("...")

    Remote mode (a SpecCache ``vllm serve`` elsewhere; no model is loaded here):
        .. code-block:: python

            llm = SpecCacheLLM(base_url="http://gpu-host:8000/v1", model="smollm2", api_key="...")
            # SpecCacheKVPrecompute(llm=llm) asks the server to store each node's KV; queries send the
            # keys of the chunks they contain, and the server reuses exactly those (docs/deploy.md)
    """

    target: Optional[str] = Field(default="smollm2-135m",
                                  description="Target model: a packaged name, a HF directory or a .gguf file "
                                  "(remote mode: the served model name; alias `model`).")
    draft: Optional[str] = Field(default=None,
                                 description="Draft model that scores tokens; None scores with the target.")
    store: Any = Field(default=DEFAULT_STORE,
                       description="KV store: a directory, 'memory://', 'redis://host:port/db' or a KVStore.")
    backend: str = Field(default="torch", description="Engine backend: 'torch' or 'vllm'.")
    dtype: str = Field(default="auto", description="Compute dtype: auto (bfloat16 where the hardware computes it "
                       "natively, else float32), bfloat16 or float32.")
    max_new_tokens: int = Field(default=64, gt=0, description="Tokens to generate at most.")
    method: str = Field(default=ReuseConfig().method,
                        description="Reuse method: qattn, speccache, norm, cacheblend, epic, reuse, full …")
    recompute_ratio: Union[float, Literal["auto"]] = Field(
        default=ReuseConfig.recompute_ratio,
        description="Share of reused chunk tokens recomputed; 'auto': chosen per prompt (ReuseConfig.auto_range).")
    offload: Union[str, OffloadConfig, None] = Field(
        default=None, description="Offloaded decoding (SpeCache), torch backend: '2bit', '1bit' or an OffloadConfig — "
        "a low-bit KV copy stays resident and the top-k rows are fetched each step.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    stop: Optional[List[str]] = Field(default=None, description="Stop strings.")
    seed: Optional[int] = Field(default=None, description="Sampling seed.")
    context_window: Optional[int] = Field(default=None,
                                          description="Context window; None reads it from the model's config.")
    use_retrieval_hints: bool = Field(default=True,
                                      description="Search retrieved nodes' texts first (RetrievalEndEvent).")
    base_url: Optional[str] = Field(default=None, description="Remote mode: a SpecCache `vllm serve` "
                                    "(http://host:8000/v1); `target` is then the served model name (None: its first).")
    api_key: Optional[str] = Field(default=None, description="Remote mode: the server's API key.")
    timeout: float = Field(default=600.0, gt=0, description="Remote mode: seconds to wait for a response.")

    _engine: Any = PrivateAttr(default=None)
    _engine_lock: Any = PrivateAttr(default_factory=threading.Lock)
    # per thread, so that concurrent callers each see their own call's statistics
    _last_stats: Any = PrivateAttr(default_factory=threading.local)
    _context: Optional[int] = PrivateAttr(default=None)
    _hints_seen: Optional[RetrievalHints] = PrivateAttr(default=None)

    def __init__(self, engine: Optional[SpecCacheEngine] = None, **kwargs: Any) -> None:
        if "model" in kwargs:                    # the OpenAI-style name of `target`
            kwargs["target"] = kwargs.pop("model")
        if engine is not None:
            kwargs.setdefault("target", engine.name)
            kwargs.setdefault("store", engine.store)
        if kwargs.get("base_url"):
            kwargs.setdefault("target", None)
            kwargs.setdefault("store", None)     # the server has the store; give one to read its text index
            if kwargs.get("offload") is not None:
                raise ValueError("offloaded decoding runs in-process only; remote mode (base_url) cannot use it")
        super().__init__(**kwargs)
        ReuseConfig(method=self.method, recompute_ratio=self.recompute_ratio)   # fail early on bad values
        OffloadConfig.parse(self.offload)
        self._engine = engine
        if self.use_retrieval_hints:
            self._hints_seen = RetrievalHints()

    @field_serializer("store")
    def _store_name(self, store: Any) -> Optional[str]:
        return store if isinstance(store, str) or store is None else type(store).__name__

    @classmethod
    def class_name(cls) -> str:
        return "SpecCacheLLM"

    # ---- the engine and what it reports --------------------------------------------------------
    @property
    def engine(self) -> Any:
        """The engine, loaded on first use: a ``SpecCacheEngine``, or in remote mode a ``RemoteEngine``."""
        with self._engine_lock:
            if self._engine is None:
                if self.base_url:
                    from speccache_rag.remote import RemoteEngine

                    self._engine = RemoteEngine(self.base_url, model=self.target, api_key=self.api_key,
                                                store=self.store, timeout=self.timeout)
                else:
                    self._engine = SpecCacheEngine.from_pretrained(self.target, draft=self.draft, store=self.store,
                                                                   backend=self.backend, dtype=self.dtype)
            return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self._context_window(), num_output=self.max_new_tokens,
                           is_chat_model=True, is_function_calling_model=False,
                           model_name=self.target or "unknown")

    def _context_window(self) -> int:
        if self.context_window is not None:
            return self.context_window
        if self._context is None:
            if self._engine is not None or self.base_url:
                self._context = self.engine.context_window       # remote: the server's, no model loaded
            else:   # read the config only: metadata must not load the weights
                from transformers import AutoConfig

                from speccache_rag.models import resolve

                self._context = AutoConfig.from_pretrained(str(resolve(self.target))).max_position_embeddings
        return self._context

    # ---- the one generation path ---------------------------------------------------------------
    def _generate_kwargs(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        return dict(
            max_new_tokens=kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens)),
            reuse=ReuseConfig(method=kwargs.get("method", self.method),
                              recompute_ratio=kwargs.get("recompute_ratio", self.recompute_ratio)),
            offload=OffloadConfig.parse(kwargs.get("offload", self.offload)),
            temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p),
            stop=kwargs.get("stop", self.stop),
            seed=kwargs.get("seed", self.seed),
        )

    @property
    def last_stats(self) -> Optional[GenerationStats]:
        """Statistics of the most recent call made from this thread (every response also
        carries its own, in ``raw["stats"]`` and ``additional_kwargs``)."""
        return getattr(self._last_stats, "stats", None)

    @property
    def retrieval_hints(self) -> Optional[RetrievalHints]:
        """The texts of the retrievals this LLM has seen (None when ``use_retrieval_hints=False``)."""
        return self._hints_seen

    def _hints(self) -> Optional[List[str]]:
        return self._hints_seen.texts() if self._hints_seen is not None else None

    def _completion_messages(self, prompt: str, formatted: bool) -> List[dict]:
        system = [] if formatted or not self.system_prompt else [{"role": "system", "content": self.system_prompt}]
        return [*system, {"role": "user", "content": prompt}]

    def _generate(self, messages: List[dict], kwargs: Dict[str, Any]) -> CompletionResponse:
        return self._final(generate_text(self.engine, messages, self._hints(), **self._generate_kwargs(kwargs)))

    async def _aengine(self) -> Any:
        """The engine, loaded in a worker thread on first use so that the event loop keeps running."""
        return self._engine or await asyncio.to_thread(lambda: self.engine)

    async def _agenerate(self, messages: List[dict], kwargs: Dict[str, Any]) -> CompletionResponse:
        gen_kwargs = self._generate_kwargs(kwargs)
        return self._final(await agenerate_text(await self._aengine(), messages, self._hints(), **gen_kwargs))

    def _final(self, out: GenerationOutput) -> CompletionResponse:
        self._last_stats.stats = out.stats
        stats = out.stats.to_dict()
        usage = out.usage or _usage(out.stats)          # remote: what the server itself reported
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", out.stats.reused_tokens)
        return CompletionResponse(text=out.text, delta="",
                                  additional_kwargs={**stats, "cached_tokens": cached},
                                  raw={"stats": stats, "finish_reason": out.finish_reason,
                                       "token_ids": out.token_ids, "usage": usage})

    def _run(self, messages: List[dict], kwargs: Dict[str, Any]) -> CompletionResponseGen:
        text = ""
        for item in stream_text(self.engine, messages, self._hints(), **self._generate_kwargs(kwargs)):
            if isinstance(item, str):
                text += item
                yield CompletionResponse(text=text, delta=item)
            else:
                yield self._final(item)

    async def _arun(self, messages: List[dict], kwargs: Dict[str, Any]) -> AsyncIterator[CompletionResponse]:
        text = ""
        gen_kwargs = self._generate_kwargs(kwargs)
        engine = await self._aengine()
        hints = self._hints()
        async for item in astream_text(engine, messages, hints, **gen_kwargs):
            if isinstance(item, str):
                text += item
                yield CompletionResponse(text=text, delta=item)
            else:
                yield self._final(item)

    # ---- completion ----------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._generate(self._completion_messages(prompt, formatted), kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._run(self._completion_messages(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await self._agenerate(self._completion_messages(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        return self._arun(self._completion_messages(prompt, formatted), kwargs)

    # ---- chat ----------------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _to_chat(self._generate(_as_dicts(messages), kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return (_to_chat(r) for r in self._run(_as_dicts(messages), kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _to_chat(await self._agenerate(_as_dicts(messages), kwargs))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        async def gen() -> ChatResponseAsyncGen:
            async for r in self._arun(_as_dicts(messages), kwargs):
                yield _to_chat(r)

        return gen()


def _usage(s: GenerationStats) -> dict:
    """The OpenAI usage shape LlamaIndex's token counting reads, with reused tokens as cached tokens."""
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.generated_tokens,
            "total_tokens": s.prompt_tokens + s.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": s.reused_tokens}}


def _as_dicts(messages: Sequence[ChatMessage]) -> List[dict]:
    out = []
    for m in messages:
        role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
        out.append({"role": _ROLES.get(role, role), "content": m.content or ""})
    return out


def _to_chat(r: CompletionResponse) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=r.text), delta=r.delta,
                        raw=r.raw, additional_kwargs=r.additional_kwargs)


__all__ = ["SpecCacheLLM"]
