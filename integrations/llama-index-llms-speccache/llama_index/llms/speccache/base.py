"""``SpecCacheLLM``: a LlamaIndex LLM whose prompts reuse the KV of precomputed chunks."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional, Sequence, Union

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
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from llama_index.llms.speccache.hints import RetrievalHints
from speccache_rag.contract import Engine
from speccache_rag.output import GenerationOutput, GenerationStats
from speccache_rag.dropin import DropIn, DropInSettings, cached_tokens, init_arguments, needs_server, usage
from speccache_rag.dropin.fields import DropInFields
from speccache_rag.matching import TOOL_FIELDS

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

_ROLES = {"developer": "system", "chatbot": "assistant", "model": "assistant"}


class SpecCacheLLM(FunctionCallingLLM, DropInFields):
    """A local LLM that reuses the KV caches of retrieved chunks, repaired by speculative recompute.

    The prompt LlamaIndex builds is searched for chunks whose KV was precomputed (by
    ``SpecCacheKVPrecompute`` in the ingestion pipeline, or seen in an earlier prompt); those are
    loaded from the store instead of prefilled, and only the tokens a draft model marks as
    important are recomputed. Everything else about the query engine stays as it is.

    Setup:
        ``pip install llama-index-llms-speccache``

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

    max_new_tokens: int = Field(default=DropInSettings.max_new_tokens, description="Tokens to generate at most.")
    context_window: Optional[int] = Field(default=None,
                                          description="Context window; None reads it from the model's config.")
    use_retrieval_hints: bool = Field(default=True,
                                      description="Search retrieved nodes' texts first (RetrievalEndEvent).")

    _core: DropIn = PrivateAttr(default_factory=DropIn)
    _context: Optional[int] = PrivateAttr(default=None)
    _hints_seen: Optional[RetrievalHints] = PrivateAttr(default=None)

    def __init__(self, engine: Optional[Engine] = None, **kwargs: Any) -> None:
        super().__init__(**init_arguments(kwargs, engine))
        self._core = DropIn(engine)
        if self.use_retrieval_hints:
            self._hints_seen = RetrievalHints()

    @classmethod
    def class_name(cls) -> str:
        return "SpecCacheLLM"

    # ---- the engine and what it reports --------------------------------------------------------
    @property
    def engine(self) -> Any:
        """The engine, loaded on first use: a ``SpecCacheEngine``, or in remote mode a ``RemoteEngine``."""
        return self._core.engine(self._settings())

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self._context_window(), num_output=self.max_new_tokens,
                           is_chat_model=True, is_function_calling_model=bool(self.base_url),
                           model_name=self.target or "unknown")

    def _context_window(self) -> int:
        if self.context_window is not None:
            return self.context_window
        if self._context is None:
            if self._core.loaded or self.base_url:
                self._context = self.engine.context_window       # remote: the server's, no model loaded
            else:   # read the config only: metadata must not load the weights
                from transformers import AutoConfig

                from speccache_rag.models import resolve

                self._context = AutoConfig.from_pretrained(str(resolve(self.target))).max_position_embeddings
        return self._context

    @property
    def last_stats(self) -> Optional[GenerationStats]:
        """Statistics of the most recent call made from this thread (every response also
        carries its own, in ``raw["stats"]`` and ``additional_kwargs``)."""
        return self._core.last_stats

    @property
    def retrieval_hints(self) -> Optional[RetrievalHints]:
        """The texts of the retrievals this LLM has seen (None when ``use_retrieval_hints=False``)."""
        return self._hints_seen

    def _precompute(self, texts: List[str], **kwargs: Any) -> List[str]:
        """The core's precompute, for ``SpecCacheKVPrecompute``."""
        return self._core.precompute(self._settings(), texts, **kwargs)

    # ---- function calling (remote mode: the vLLM server parses the calls) --------------------------
    def _prepare_chat_with_tools(self, tools: Sequence["BaseTool"], user_msg: Optional[Union[str, ChatMessage]] = None,
                                 chat_history: Optional[List[ChatMessage]] = None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 **kwargs: Any) -> Dict[str, Any]:
        if not self.base_url:
            raise needs_server("function calling")
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        specs = [t.metadata.to_openai_tool() for t in tools]
        with_tools = {"tools": specs, "tool_choice": "required" if tool_required else "auto",
                      "parallel_tool_calls": allow_parallel_tool_calls} if specs else {}
        return {"messages": messages, **with_tools, **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> List[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got none (text: {response.message.content!r})")
        return [ToolSelection(tool_id=c.get("id") or "", tool_name=c["function"]["name"],
                              tool_kwargs=json.loads(c["function"]["arguments"] or "{}")) for c in calls]

    # ---- the one generation path ---------------------------------------------------------------
    def _hints(self) -> Optional[List[str]]:
        return self._hints_seen.texts() if self._hints_seen is not None else None

    def _completion_messages(self, prompt: str, formatted: bool) -> List[dict]:
        system = [] if formatted or not self.system_prompt else [{"role": "system", "content": self.system_prompt}]
        return [*system, {"role": "user", "content": prompt}]

    def _generate(self, messages: List[dict], kwargs: Dict[str, Any]) -> CompletionResponse:
        return _final(self._core.generate(self._settings(), messages, self._hints(), **kwargs))

    async def _agenerate(self, messages: List[dict], kwargs: Dict[str, Any]) -> CompletionResponse:
        return _final(await self._core.agenerate(self._settings(), messages, self._hints(), **kwargs))

    def _run(self, messages: List[dict], kwargs: Dict[str, Any]) -> CompletionResponseGen:
        text = ""
        for item in self._core.stream(self._settings(), messages, self._hints(), **kwargs):
            if isinstance(item, str):
                text += item
                yield CompletionResponse(text=text, delta=item)
            else:
                yield _final(item)

    async def _arun(self, messages: List[dict], kwargs: Dict[str, Any]) -> AsyncIterator[CompletionResponse]:
        text = ""
        async for item in self._core.astream(self._settings(), messages, self._hints(), **kwargs):
            if isinstance(item, str):
                text += item
                yield CompletionResponse(text=text, delta=item)
            else:
                yield _final(item)

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


def _final(out: GenerationOutput) -> CompletionResponse:
    stats = out.stats.to_dict()
    calls = {"tool_calls": out.tool_calls} if out.tool_calls else {}
    return CompletionResponse(text=out.text, delta="",
                              additional_kwargs={**stats, "cached_tokens": cached_tokens(out), **calls},
                              raw={"stats": stats, "finish_reason": out.finish_reason, "token_ids": out.token_ids,
                                   "usage": usage(out)})


def _as_dicts(messages: Sequence[ChatMessage]) -> List[dict]:
    out = []
    for m in messages:
        role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
        extra = {k: m.additional_kwargs[k] for k in TOOL_FIELDS if m.additional_kwargs.get(k)}
        out.append({"role": _ROLES.get(role, role), "content": m.content or "", **extra})
    return out


def _to_chat(r: CompletionResponse) -> ChatResponse:
    calls = {"tool_calls": r.additional_kwargs["tool_calls"]} if r.additional_kwargs.get("tool_calls") else {}
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=r.text, additional_kwargs=calls),
                        delta=r.delta, raw=r.raw, additional_kwargs=r.additional_kwargs)


__all__ = ["SpecCacheLLM"]
