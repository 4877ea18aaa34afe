"""``SpecCachePrecompute``: precompute the KV of documents as a step of an ingestion flow."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from langchain_core.documents import BaseDocumentTransformer, Document
from langchain_core.embeddings import Embeddings

from langchain_speccache.chat_models import ChatSpecCache


class SpecCachePrecompute(BaseDocumentTransformer):
    """Precomputes each document's KV cache (its ``page_content``) and returns the documents unchanged.

    .. code-block:: python

        chunks = splitter.split_documents(docs)
        chunks = SpecCachePrecompute(chat, embeddings=embeddings, neighbors=2).transform_documents(chunks)
        vectorstore = FAISS.from_documents(chunks, embeddings)

    ``neighbors=k`` (with the retriever's ``embeddings``) also stores each chunk prefilled after its k
    nearest chunks of the batch: queries that retrieve those chunks together read that KV instead, which has
    already seen its neighbours (closer to full prefill for the same recompute budget).
    """

    def __init__(self, chat: ChatSpecCache, show_progress: bool = False, embeddings: Optional[Embeddings] = None,
                 neighbors: int = 0) -> None:
        if neighbors and embeddings is None:
            raise ValueError("SpecCachePrecompute(neighbors=...) needs embeddings= (the retriever's embedding model)")
        self.chat, self.show_progress = chat, show_progress
        self.embeddings, self.neighbors = embeddings, neighbors

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        self.chat.precompute(documents, progress=kwargs.get("show_progress", self.show_progress),
                             embeddings=self.embeddings, neighbors=self.neighbors)
        return documents
