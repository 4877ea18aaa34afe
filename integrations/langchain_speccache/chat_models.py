"""``ChatSpecCache``: a LangChain chat model whose prompts reuse the KV of precomputed chunks."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Iterable, Iterator, Literal, Optional, Sequence, Union

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, field_serializer, model_validator

from langchain_speccache.callbacks import RetrievalHints
from speccache_rag import GenerationOutput, GenerationStats, OffloadConfig, ReuseConfig, SpecCacheEngine
from speccache_rag.config import DEFAULT_STORE
from speccache_rag.matching import (
    agenerate_text,
    astream_text,
    chunk_index,
    generate_text,
    precompute_texts,
    stream_text,
)


class ChatSpecCache(BaseChatModel):
    """A local chat model that reuses the KV caches of retrieved chunks, repaired by speculative recompute.

    The messages a chain sends are searched for chunks whose KV was precomputed (``precompute``)
    or seen before; those are loaded from the store instead of prefilled, and only the tokens a
    draft model marks as important are recomputed.

    Setup:
        ``pip install 'speccache-rag[langchain]'``

    Instantiate:
        .. code-block:: python

            from langchain_speccache import ChatSpecCache

            chat = ChatSpecCache(target="smollm2-135m", draft="smollm2-135m", store="./kv",
                                 max_tokens=64, temperature=0)

        Construction is cheap: the model loads on the first call (or ``chat.engine``).

    Precompute (at ingestion):
        .. code-block:: python

            chat.precompute(chunks)            # strings or Documents (their page_content)

    Invoke:
        .. code-block:: python

            msg = chat.invoke([("system", f"Context:\\n{context}"), ("human", question)])
            msg.usage_metadata["input_token_details"]["cache_read"]   # reused prompt tokens
            msg.response_metadata["speccache"]                        # all reuse statistics

    Stream:
        .. code-block:: python

            for chunk in chat.stream(messages):
                print(chunk.content, end="")

    In an LCEL chain, pass the retriever hints along (optional; narrows the search):
        .. code-block:: python

            chain.invoke(question, config={"callbacks": [chat.retrieval_hints]})

    Remote mode (a SpecCache ``vllm serve`` elsewhere; no model is loaded here):
        .. code-block:: python

            chat = ChatSpecCache(base_url="http://gpu-host:8000/v1", model="smollm2", api_key="...")
            chat.precompute(chunks)            # the server computes and stores each chunk's KV
            # queries send the keys of the chunks found in the messages (docs/deploy.md)
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    target: Optional[str] = Field(default="smollm2-135m", alias="model",
                                  description="Target model: a packaged name, a HF directory or a .gguf file "
                                  "(remote mode: the served model name; None: the server's first).")
    draft: Optional[str] = Field(default=None, description="Draft model that scores tokens; None: the target.")
    store: Any = Field(default=DEFAULT_STORE,
                       description="KV store: a directory, 'memory://', 'redis://host:port/db' or a KVStore.")
    backend: str = Field(default="torch", description="Engine backend: 'torch' or 'vllm'.")
    dtype: str = Field(default="auto", description="Compute dtype: auto (bfloat16 where the hardware computes it "
                       "natively, else float32), bfloat16 or float32.")
    method: str = Field(default=ReuseConfig().method,
                        description="Reuse method: qattn, speccache, norm, cacheblend, epic, reuse, full …")
    recompute_ratio: Union[float, Literal["auto"]] = Field(
        default=ReuseConfig.recompute_ratio,
        description="Share of reused chunk tokens recomputed; 'auto': chosen per prompt (ReuseConfig.auto_range).")
    offload: Union[str, OffloadConfig, None] = Field(
        default=None, description="Offloaded decoding (SpeCache), torch backend: '2bit', '1bit' or an OffloadConfig — "
        "a low-bit KV copy stays resident and the top-k rows are fetched each step.")
    max_tokens: int = Field(default=64, gt=0, alias="max_new_tokens", description="Tokens to generate at most.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    stop: Optional[list[str]] = Field(default=None, alias="stop_sequences", description="Stop strings.")
    seed: Optional[int] = Field(default=None, description="Sampling seed.")
    streaming: bool = Field(default=False, description="Generate through _stream even for invoke.")
    use_retrieval_hints: bool = Field(default=True, description="Search hinted documents' texts first.")
    base_url: Optional[str] = Field(default=None, description="Remote mode: a SpecCache `vllm serve` "
                                    "(http://host:8000/v1).")
    api_key: Optional[str] = Field(default=None, description="Remote mode: the server's API key.")
    timeout: Optional[float] = Field(default=None, description="Remote mode: seconds to wait (None: 600).")
    max_retries: int = Field(default=2, description="Remote mode: retries of a failed connection.")

    _engine: Any = PrivateAttr(default=None)
    _engine_lock: Any = PrivateAttr(default_factory=threading.Lock)
    # per thread, so that concurrent callers each see their own call's statistics
    _last_stats: Any = PrivateAttr(default_factory=threading.local)
    _hints: RetrievalHints = PrivateAttr(default_factory=RetrievalHints)

    def __init__(self, engine: Optional[SpecCacheEngine] = None, **kwargs: Any) -> None:
        if engine is not None:
            kwargs.setdefault("target", engine.name)
            kwargs.setdefault("store", engine.store)
        if kwargs.get("base_url"):
            if "model" not in kwargs:
                kwargs.setdefault("target", None)
            kwargs.setdefault("store", None)     # the server has the store; give one to read its text index
        super().__init__(**kwargs)
        self._engine = engine

    @model_validator(mode="after")
    def _check_reuse(self) -> "ChatSpecCache":
        ReuseConfig(method=self.method, recompute_ratio=self.recompute_ratio)   # fail early on bad values
        OffloadConfig.parse(self.offload)
        if self.base_url and self.offload is not None:
            raise ValueError("offloaded decoding runs in-process only; remote mode (base_url) cannot use it")
        return self

    @field_serializer("store")
    def _store_name(self, store: Any) -> Optional[str]:
        return store if isinstance(store, str) or store is None else type(store).__name__

    # ---- the engine and what it reports --------------------------------------------------------
    @property
    def engine(self) -> Any:
        """The engine, loaded on first use: a ``SpecCacheEngine``, or in remote mode a ``RemoteEngine``."""
        with self._engine_lock:
            if self._engine is None:
                if self.base_url:
                    from speccache_rag.remote import RemoteEngine

                    self._engine = RemoteEngine(self.base_url, model=self.target, api_key=self.api_key,
                                                store=self.store, timeout=self.timeout or 600.0,
                                                max_retries=self.max_retries)
                else:
                    self._engine = SpecCacheEngine.from_pretrained(self.target, draft=self.draft, store=self.store,
                                                                   backend=self.backend, dtype=self.dtype)
            return self._engine

    @property
    def last_stats(self) -> Optional[GenerationStats]:
        """Statistics of the most recent call made from this thread (every response also
        carries its own, in ``usage_metadata`` and ``response_metadata["speccache"]``)."""
        return getattr(self._last_stats, "stats", None)

    @property
    def retrieval_hints(self) -> RetrievalHints:
        """Callback handler to pass in a chain's config so retrieved documents become hints."""
        return self._hints

    def precompute(self, texts_or_documents: Iterable[Union[str, Document]], progress: bool = False,
                   engine: Optional[SpecCacheEngine] = None, embeddings: Optional[Embeddings] = None,
                   neighbors: int = 0) -> list[str]:
        """Precompute the KV of each chunk (a string, or a Document's ``page_content``); → store keys.

        Remote mode: the server computes and stores it (``chat.engine.last_precompute``: new / already
        stored / failed); or pass a local ``engine`` writing to the store the server reads — refused
        with ``ValueError`` unless the server would read its KV (same model fingerprint).
        ``neighbors=k`` with ``embeddings`` (the retriever's): each chunk is also stored prefilled after its
        k nearest chunks of this batch, which queries that retrieve them too read (closer to full prefill)."""
        texts = [d.page_content if isinstance(d, Document) else d for d in texts_or_documents]
        vectors = embeddings.embed_documents([t.strip() for t in texts]) if neighbors and embeddings else None
        if engine is None:
            return precompute_texts(self.engine, texts, progress=progress, embeddings=vectors, neighbors=neighbors)
        if not self.base_url:
            raise ValueError("precompute(engine=...) is for remote mode; a local ChatSpecCache has its own engine")
        self.engine.check_engine(engine)
        keys = precompute_texts(engine, texts, progress=progress, embeddings=vectors, neighbors=neighbors)
        chunk_index(self.engine).add([t.strip() for t in texts], keys)
        return keys

    @property
    def _llm_type(self) -> str:
        return "speccache"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"target": self.target, "draft": self.draft, "method": self.method,
                "recompute_ratio": self.recompute_ratio, "offload": self.offload, "store": self._store_name(self.store)}

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="speccache", ls_model_name=kwargs.get("model", self.target),
                                 ls_model_type="chat",
                                 ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # ---- generation ----------------------------------------------------------------------------
    def _generate_kwargs(self, stop: Optional[list[str]], kwargs: dict[str, Any]) -> dict[str, Any]:
        if kwargs.get("model", self.target) != self.target:
            raise ValueError(f"ChatSpecCache serves the one model it loaded ({self.target!r}); "
                             f"build another ChatSpecCache(target={kwargs['model']!r}) instead")
        return dict(
            max_new_tokens=kwargs.get("max_tokens", self.max_tokens),
            reuse=ReuseConfig(method=kwargs.get("method", self.method),
                              recompute_ratio=kwargs.get("recompute_ratio", self.recompute_ratio)),
            offload=OffloadConfig.parse(kwargs.get("offload", self.offload)),
            temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p),
            stop=stop if stop is not None else self.stop,
            seed=kwargs.get("seed", self.seed),
        )

    def _hint_texts(self) -> Optional[list[str]]:
        return self._hints.texts() if self.use_retrieval_hints else None

    def _metadata(self, out: GenerationOutput) -> dict[str, Any]:
        s = out.stats
        self._last_stats.stats = s
        # remote: the server's own count of cached prompt tokens
        cached = ((out.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", s.reused_tokens)
        usage = UsageMetadata(input_tokens=s.prompt_tokens, output_tokens=s.generated_tokens,
                              total_tokens=s.prompt_tokens + s.generated_tokens,
                              input_token_details={"cache_read": cached})
        response = {"model_name": self.target or self.engine.name, "model_provider": "speccache",
                    "finish_reason": out.finish_reason,
                    "speccache": s.to_dict()}
        return {"usage_metadata": usage, "response_metadata": response}

    def _chunk(self, item: Union[str, GenerationOutput]) -> ChatGenerationChunk:
        if isinstance(item, str):
            return ChatGenerationChunk(message=AIMessageChunk(content=item))
        # The last chunk carries usage and statistics once, so that aggregating a stream counts them once.
        return ChatGenerationChunk(message=AIMessageChunk(content="", chunk_position="last", **self._metadata(item)),
                                   generation_info={"finish_reason": item.finish_reason})

    def _result(self, out: GenerationOutput) -> ChatResult:
        message = AIMessage(content=out.text, **self._metadata(out))
        return ChatResult(generations=[ChatGeneration(message=message,
                                                      generation_info={"finish_reason": out.finish_reason})])

    def _stream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for item in stream_text(self.engine, _as_dicts(messages), self._hint_texts(),
                                **self._generate_kwargs(stop, kwargs)):
            chunk = self._chunk(item)
            if run_manager and isinstance(item, str):
                run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async for item in astream_text(await self._aengine(), _as_dicts(messages), self._hint_texts(),
                                       **self._generate_kwargs(stop, kwargs)):
            chunk = self._chunk(item)
            if run_manager and isinstance(item, str):
                await run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk

    def _generate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        out = generate_text(self.engine, _as_dicts(messages), self._hint_texts(), **self._generate_kwargs(stop, kwargs))
        return self._result(out)

    async def _agenerate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
        out = await agenerate_text(await self._aengine(), _as_dicts(messages), self._hint_texts(),
                                   **self._generate_kwargs(stop, kwargs))
        return self._result(out)

    async def _aengine(self) -> SpecCacheEngine:
        """The engine, loaded in a worker thread on first use so that the event loop keeps running."""
        return self._engine or await asyncio.to_thread(lambda: self.engine)


def _content_text(content: Union[str, list]) -> str:
    if isinstance(content, str):
        return content
    return "".join(block if isinstance(block, str) else block.get("text", "") for block in content
                   if isinstance(block, str) or block.get("type") == "text")


def _as_dicts(messages: Sequence[BaseMessage]) -> list[dict]:
    out = []
    for m in messages:
        if isinstance(m, SystemMessage):
            role = "system"
        elif isinstance(m, HumanMessage):
            role = "user"
        elif isinstance(m, AIMessage):
            role = "assistant"
        elif isinstance(m, ToolMessage):
            role = "tool"
        elif isinstance(m, ChatMessage):
            role = m.role
        else:
            raise ValueError(f"ChatSpecCache cannot send a {type(m).__name__} to the model")
        out.append({"role": role, "content": _content_text(m.content)})
    return out
