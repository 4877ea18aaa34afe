"""``RetrievalHints``: a callback handler that tells ``ChatSpecCache`` which documents were retrieved."""
from __future__ import annotations

from typing import Any, Sequence

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document

from speccache_rag.dropin import RecentRetrievals


class RetrievalHints(RecentRetrievals, BaseCallbackHandler):
    """Records the ``page_content`` of the documents of the last few retrievals.

    ``ChatSpecCache`` searches its prompt for these texts first. Hints only narrow the search: a
    chunk is reused only where its exact text is found in the prompt.

    .. code-block:: python

        chain.invoke(question, config={"callbacks": [chat.retrieval_hints]})
    """

    run_inline = True           # called in the event loop's thread for async chains too

    def on_retriever_end(self, documents: Sequence[Document], **kwargs: Any) -> None:
        self.add([d.page_content for d in documents])
