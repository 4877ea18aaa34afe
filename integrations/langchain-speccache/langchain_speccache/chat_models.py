"""``ChatSpecCache``: a LangChain chat model whose prompts reuse the KV of precomputed chunks."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Literal, Optional, Sequence, Union

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
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel, Field, PrivateAttr

from langchain_speccache.callbacks import RetrievalHints
from speccache_rag.contract import Engine
from speccache_rag.output import GenerationOutput, GenerationStats
from speccache_rag.dropin import DropIn, DropInSettings, cached_tokens, init_arguments, needs_server, store_name
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

    # ---- tools and structured output (remote mode: the vLLM server parses and guides) ---------------
    def _need_server(self, what: str) -> None:
        if not self.base_url:
            raise needs_server(what)

    def bind_tools(self, tools: Sequence[Union[dict[str, Any], type, Callable, BaseTool]], *,
                   tool_choice: Optional[Union[str, bool, dict]] = None, **kwargs: Any) -> Runnable:
        """Tools in OpenAI's format, sent to the server with every call; chunk reuse is unchanged.
        ``tool_choice``: a tool's name, "auto", "none", "required"/"any"/True, or OpenAI's dict."""
        self._need_server("bind_tools")
        formatted = [convert_to_openai_tool(t) for t in tools]
        if tool_choice in ("any", True):
            tool_choice = "required"
        elif isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        return super().bind(tools=formatted, **({"tool_choice": tool_choice} if tool_choice else {}), **kwargs)

    def with_structured_output(self, schema: Union[dict[str, Any], type], *, include_raw: bool = False,
                               method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
                               strict: Optional[bool] = None, **kwargs: Any) -> Runnable:
        """Outputs parsed into ``schema``: by a forced tool call (``function_calling``), by the server's guided
        decoding against the JSON schema (``json_schema``), or as any JSON object (``json_mode``)."""
        self._need_server("with_structured_output")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if kwargs:
            raise ValueError(f"unsupported argument(s) {', '.join(sorted(kwargs))}")
        if method == "json_mode":
            fmt: dict[str, Any] = {"type": "json_object"}
        elif method == "json_schema":
            spec = convert_to_json_schema(schema)
            fmt = {"type": "json_schema", "json_schema": {"name": spec.get("title", "output"), "schema": spec,
                                                          **({"strict": strict} if strict is not None else {})}}
        else:
            raise ValueError(f"method must be function_calling, json_schema or json_mode, got {method!r}")
        parser = (PydanticOutputParser(pydantic_object=schema) if isinstance(schema, type) and
                  issubclass(schema, BaseModel) else JsonOutputParser())
        llm = super().bind(response_format=fmt, ls_structured_output_format={"kwargs": {"method": method},
                                                                           "schema": schema})
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=lambda x: parser.invoke(x["raw"]), parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

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
        # The last chunk carries usage, statistics and tool calls once, so that aggregating a stream counts them once.
        calls = [tool_call_chunk(name=c["function"]["name"], args=c["function"]["arguments"], id=c.get("id"), index=i)
                 for i, c in enumerate(item.tool_calls or ())]
        return ChatGenerationChunk(message=AIMessageChunk(content="", chunk_position="last", tool_call_chunks=calls,
                                                          **self._metadata(item)),
                                   generation_info={"finish_reason": item.finish_reason})

    def _result(self, out: GenerationOutput) -> ChatResult:
        calls = [{"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"] or "{}"),
                  "id": c.get("id"), "type": "tool_call"} for c in out.tool_calls or ()]
        message = AIMessage(content=out.text, tool_calls=calls, **self._metadata(out))
        return ChatResult(generations=[ChatGeneration(message=message,
                                                      generation_info={"finish_reason": out.finish_reason})])

    def _stream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        kwargs.pop("ls_structured_output_format", None)        # LangChain's tracing, not a model argument
        for item in self._core.stream(self._settings(), _as_dicts(messages), self._hint_texts(), stop=stop, **kwargs):
            chunk = self._chunk(item)
            if run_manager and isinstance(item, str):
                run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        kwargs.pop("ls_structured_output_format", None)
        async for item in self._core.astream(self._settings(), _as_dicts(messages), self._hint_texts(), stop=stop,
                                             **kwargs):
            chunk = self._chunk(item)
            if run_manager and isinstance(item, str):
                await run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk

    def _generate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        kwargs.pop("ls_structured_output_format", None)
        if self.streaming:
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        return self._result(self._core.generate(self._settings(), _as_dicts(messages), self._hint_texts(), stop=stop,
                                                **kwargs))

    async def _agenerate(self, messages: list[BaseMessage], stop: Optional[list[str]] = None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        kwargs.pop("ls_structured_output_format", None)
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
        message = {"role": role, "content": _content_text(m.content)}
        if isinstance(m, AIMessage) and m.tool_calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": json.dumps(c["args"])}}
                                     for c in m.tool_calls]
        if isinstance(m, ToolMessage):
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out
