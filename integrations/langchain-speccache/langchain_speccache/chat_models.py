"""``ChatSpecCache``: a LangChain chat model whose prompts reuse the KV of precomputed chunks."""
from __future__ import annotations

from typing import Any, AsyncIterator, Iterable, Iterator, Optional, Sequence, Union

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
from pydantic import Field, PrivateAttr

from langchain_speccache.callbacks import RetrievalHints
from speccache_rag.contract import Engine
from speccache_rag.output import GenerationOutput, GenerationStats
from speccache_rag.dropin import DropIn, DropInSettings, cached_tokens, init_arguments, store_name
from speccache_rag.dropin.fields import DropInFields


class ChatSpecCache(BaseChatModel, DropInFields):
    """A local chat model that reuses the KV caches of retrieved chunks, repaired by speculative recompute.

    The messages a chain sends are searched for chunks whose KV was precomputed (``precompute``)
    or seen before; those are loaded from the store instead of prefilled, and only the tokens a
    draft model marks as important are recomputed.

    Setup:
        ``pip install langchain-speccache``

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

    _renamed = {"max_new_tokens": "max_tokens"}

    max_tokens: int = Field(default=DropInSettings.max_new_tokens, alias="max_new_tokens",
                            description="Tokens to generate at most.")
    streaming: bool = Field(default=False, description="Generate through _stream even for invoke.")
    use_retrieval_hints: bool = Field(default=True, description="Search hinted documents' texts first.")

    _core: DropIn = PrivateAttr(default_factory=DropIn)
    _hints: RetrievalHints = PrivateAttr(default_factory=RetrievalHints)

    def __init__(self, engine: Optional[Engine] = None, **kwargs: Any) -> None:
        super().__init__(**init_arguments(kwargs, engine))
        self._core = DropIn(engine)

    # ---- the engine and what it reports --------------------------------------------------------
    @property
    def engine(self) -> Any:
        """The engine, loaded on first use: a ``SpecCacheEngine``, or in remote mode a ``RemoteEngine``."""
        return self._core.engine(self._settings())

    @property
    def last_stats(self) -> Optional[GenerationStats]:
        """Statistics of the most recent call made from this thread (every response also
        carries its own, in ``usage_metadata`` and ``response_metadata["speccache"]``)."""
        return self._core.last_stats

    @property
    def retrieval_hints(self) -> RetrievalHints:
        """Callback handler to pass in a chain's config so retrieved documents become hints."""
        return self._hints

    def precompute(self, texts_or_documents: Iterable[Union[str, Document]], progress: bool = False,
                   engine: Optional[Engine] = None, embeddings: Optional[Embeddings] = None,
                   neighbors: int = 0) -> list[str]:
        """Precompute the KV of each chunk (a string, or a Document's ``page_content``); → store keys.

        Remote mode: the server computes and stores it (``chat.engine.last_precompute``: new / already
        stored / failed); or pass a local ``engine`` writing to the store the server reads — refused
        with ``ValueError`` unless the server would read its KV (same model fingerprint).
        ``neighbors=k`` with ``embeddings`` (the retriever's): each chunk is also stored prefilled after its
        k nearest chunks of this batch, which queries that retrieve them too read (closer to full prefill)."""
        texts = [d.page_content if isinstance(d, Document) else d for d in texts_or_documents]
        vectors = embeddings.embed_documents([t.strip() for t in texts]) if neighbors and embeddings else None
        return self._core.precompute(self._settings(), texts, progress=progress, engine=engine, embeddings=vectors,
                                     neighbors=neighbors)

    @property
    def _llm_type(self) -> str:
        return "speccache"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"target": self.target, "draft": self.draft, "method": self.method,
                "recompute_ratio": self.recompute_ratio, "offload": self.offload, "store": store_name(self.store)}

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="speccache", ls_model_name=kwargs.get("model", self.target),
                                 ls_model_type="chat",
                                 ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # ---- generation ----------------------------------------------------------------------------
    def _hint_texts(self) -> Optional[list[str]]:
        return self._hints.texts() if self.use_retrieval_hints else None

    def _metadata(self, out: GenerationOutput) -> dict[str, Any]:
        s = out.stats
        usage = UsageMetadata(input_tokens=s.prompt_tokens, output_tokens=s.generated_tokens,
                              total_tokens=s.prompt_tokens + s.generated_tokens,
                              input_token_details={"cache_read": cached_tokens(out)})
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
        for item in self._core.stream(self._settings(), _as_dicts(messages), self._hint_texts(), stop=stop, **kwargs):
            chunk = self._chunk(item)
            if run_manager and isinstance(item, str):
                run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async for item in self._core.astream(self._settings(), _as_dicts(messages), self._hint_texts(), stop=stop,
                                             **kwargs):
            chunk = self._chunk(item)
            if run_manager and isinstance(item, str):
                await run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk

    def _generate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        return self._result(self._core.generate(self._settings(), _as_dicts(messages), self._hint_texts(), stop=stop,
                                                **kwargs))

    async def _agenerate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        if self.streaming:
            return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
        return self._result(await self._core.agenerate(self._settings(), _as_dicts(messages), self._hint_texts(),
                                                       stop=stop, **kwargs))


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
