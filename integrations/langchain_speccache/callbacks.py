"""``RetrievalHints``: a callback handler that tells ``ChatSpecCache`` which documents were retrieved."""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Sequence

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document

RECENT_RETRIEVALS = 8       # hint sets kept (concurrent chains each add their own)


class RetrievalHints(BaseCallbackHandler):
    """Records the ``page_content`` of the documents of the last few retrievals.

    ``ChatSpecCache`` searches its prompt for these texts first. Hints only narrow the search: a
    chunk is reused only where its exact text is found in the prompt.

    .. code-block:: python

        chain.invoke(question, config={"callbacks": [chat.retrieval_hints]})
    """

    run_inline = True           # called in the event loop's thread for async chains too

    def __init__(self) -> None:
        self._recent: deque[list[str]] = deque(maxlen=RECENT_RETRIEVALS)
        self._lock = threading.Lock()

    def on_retriever_end(self, documents: Sequence[Document], **kwargs: Any) -> None:
        with self._lock:
            self._recent.append([d.page_content for d in documents])

    def texts(self) -> list[str]:
        """Hint texts, most recent retrieval first (no duplicates)."""
        with self._lock:
            batches = list(self._recent)
        return list(dict.fromkeys(t for batch in reversed(batches) for t in batch))

    def clear(self) -> None:
        with self._lock:
            self._recent.clear()
