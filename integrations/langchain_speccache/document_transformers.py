"""``SpecCachePrecompute``: precompute the KV of documents as a step of an ingestion flow."""
from __future__ import annotations

from typing import Any, Sequence

from langchain_core.documents import BaseDocumentTransformer, Document

from langchain_speccache.chat_models import ChatSpecCache


class SpecCachePrecompute(BaseDocumentTransformer):
    """Precomputes each document's KV cache (its ``page_content``) and returns the documents unchanged.

    .. code-block:: python

        chunks = splitter.split_documents(docs)
        chunks = SpecCachePrecompute(chat).transform_documents(chunks)
        vectorstore = FAISS.from_documents(chunks, embeddings)
    """

    def __init__(self, chat: ChatSpecCache, show_progress: bool = False) -> None:
        self.chat = chat
        self.show_progress = show_progress

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        self.chat.precompute(documents, progress=kwargs.get("show_progress", self.show_progress))
        return documents
