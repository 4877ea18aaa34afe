"""Retrieval hints: the texts of the nodes LlamaIndex retrievers just returned.

A handler on the root instrumentation dispatcher records every ``RetrievalEndEvent``; ``SpecCacheLLM``
then looks for those texts first when it receives a prompt. Hints only narrow the search: a hint
that is not in the prompt is ignored, and a chunk is reused only where its exact text is found.
"""
from __future__ import annotations

import threading
from typing import Any, List

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.schema import MetadataMode
from pydantic import PrivateAttr

from speccache_rag.matching import RecentRetrievals

RECENT_RETRIEVALS = 8       # hint sets kept (concurrent queries each add their own)


class RetrievalHints(BaseEventHandler):
    """Keeps the LLM-mode texts of the nodes of the last few retrievals."""

    _recent: RecentRetrievals = PrivateAttr(default_factory=lambda: RecentRetrievals(RECENT_RETRIEVALS))

    @classmethod
    def class_name(cls) -> str:
        return "SpecCacheRetrievalHints"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in event.nodes]
            self._recent.add(texts)

    def texts(self) -> List[str]:
        """Hint texts, most recent retrieval first (no duplicates)."""
        return self._recent.texts()

    def clear(self) -> None:
        self._recent.clear()


_handler: RetrievalHints | None = None
_install_lock = threading.Lock()


def retrieval_hints() -> RetrievalHints:
    """The process-wide hint handler, attached to the root dispatcher on first use."""
    global _handler
    with _install_lock:
        if _handler is None:
            _handler = RetrievalHints()
            get_dispatcher().add_event_handler(_handler)
        return _handler
