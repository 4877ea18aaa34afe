"""Retrieval hints: the texts of the nodes LlamaIndex retrievers just returned.

Every ``SpecCacheLLM`` owns a :class:`RetrievalHints`; one handler on the root instrumentation
dispatcher (the only place retrieval events reach) hands each ``RetrievalEndEvent`` to the hint
sets of the LLMs alive, which then look for those texts first when they receive a prompt. Hints
only narrow the search: a hint that is not in the prompt is ignored, and a chunk is reused only
where its exact text is found.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.schema import MetadataMode
from pydantic import PrivateAttr

from speccache_rag.dropin import RecentRetrievals


class RetrievalHints(RecentRetrievals):
    """One LLM's hints: the LLM-mode texts of the nodes of the last few retrievals."""

    def __init__(self) -> None:
        super().__init__()
        _forwarder().attach(self)


class _Forwarder(BaseEventHandler):
    """The root dispatcher's handler: retrieved texts go to every live ``RetrievalHints`` (held weakly, so
    an LLM that is gone stops receiving them)."""

    _targets: Any = PrivateAttr(default_factory=weakref.WeakSet)

    @classmethod
    def class_name(cls) -> str:
        return "SpecCacheRetrievalHints"

    _lock: Any = PrivateAttr(default_factory=threading.Lock)

    def attach(self, hints: RetrievalHints) -> None:
        with self._lock:
            self._targets.add(hints)

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, RetrievalEndEvent):
            texts = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in event.nodes]
            with self._lock:                        # an LLM built on another thread may be attaching
                targets = list(self._targets)
            for hints in targets:
                hints.add(texts)


_handler: _Forwarder | None = None
_install_lock = threading.Lock()


def _forwarder() -> _Forwarder:
    global _handler
    with _install_lock:
        if _handler is None:
            _handler = _Forwarder()
            get_dispatcher().add_event_handler(_handler)
        return _handler
