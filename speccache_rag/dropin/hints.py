"""``RecentRetrievals``: what the frameworks' retrievers just returned, kept as hints for the next prompts."""
from __future__ import annotations

import threading
from collections import deque

RECENT_RETRIEVALS = 8       # retrievals kept: concurrent queries each add their own


class RecentRetrievals:
    """The chunk texts of the last few retrievals, thread-safe: what the frameworks' retriever
    callbacks record as hints. Hints only narrow the search: a chunk is reused only where its exact
    text is found in the prompt."""

    def __init__(self, keep: int = RECENT_RETRIEVALS):
        self._batches: deque[list[str]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, texts: list[str]) -> None:
        with self._lock:
            self._batches.append(texts)

    def texts(self) -> list[str]:
        """Hint texts, most recent retrieval first (no duplicates)."""
        with self._lock:
            batches = list(self._batches)
        return list(dict.fromkeys(t for batch in reversed(batches) for t in batch))

    def clear(self) -> None:
        with self._lock:
            self._batches.clear()
