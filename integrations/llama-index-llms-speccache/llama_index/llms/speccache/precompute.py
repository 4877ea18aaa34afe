"""``SpecCacheKVPrecompute``: the ingestion step that precomputes each node's KV cache."""
from __future__ import annotations

import asyncio
from typing import Any, Optional, Sequence

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

from llama_index.llms.speccache.base import SpecCacheLLM
from speccache_rag.contract import Engine
from speccache_rag.dropin import precompute_texts
from speccache_rag.remote import PrecomputeSummary


class SpecCacheKVPrecompute(TransformComponent):
    """Precomputes the KV cache of every node, as the LLM will see it, and passes the nodes on unchanged.

    The text stored is ``node.get_content(metadata_mode=MetadataMode.LLM)`` stripped, which is what
    the response synthesizers put into the prompt. Idempotent: chunks already stored are skipped.
    The engine is a private attribute, so the ``IngestionPipeline`` cache hash depends only on the
    model name, the store and the metadata mode.

    .. code-block:: python

        llm = SpecCacheLLM(target="smollm2-135m", store="./kv")
        pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=256), embed_model,
                                                      SpecCacheKVPrecompute(llm=llm)])
        nodes = pipeline.run(documents=documents)

    With a remote LLM (``SpecCacheLLM(base_url=...)``) the server computes and stores the KV
    (``transform.last_summary``: new / already stored / failed). Passing ``engine=`` as well computes
    it with that local engine into the store the server reads — after checking that the server
    would read it (same model fingerprint), else ``ValueError``.
    """

    model_name: str = Field(default="", description="Target model whose KV is computed.")
    store: str = Field(default="", description="Where the KV goes.")
    metadata_mode: MetadataMode = Field(default=MetadataMode.LLM, description="How node text is rendered.")
    show_progress: bool = Field(default=False, description="Show a progress bar.")
    neighbors: int = Field(default=0, ge=0, description="Also store each node's KV prefilled after its k nearest "
                                                        "nodes (by node.embedding: embed before this step).")

    _llm: Optional[SpecCacheLLM] = PrivateAttr(default=None)
    _engine: Optional[Engine] = PrivateAttr(default=None)

    def __init__(self, llm: Optional[SpecCacheLLM] = None, engine: Optional[Engine] = None,
                 **kwargs: Any) -> None:
        remote = llm is not None and bool(llm.base_url)
        if (llm is None) == (engine is None) and not (remote and engine is not None):
            raise ValueError("SpecCacheKVPrecompute needs one of llm=SpecCacheLLM(...) or engine=... "
                             "(both only with a remote llm, whose server then reads what the engine stores)")
        store = engine.store if engine is not None else llm.store
        kwargs.setdefault("model_name", engine.name if engine is not None else (llm.target or ""))
        kwargs.setdefault("store", store if isinstance(store, str) else type(store).__name__)
        super().__init__(**kwargs)
        self._llm, self._engine = llm, engine

    @classmethod
    def class_name(cls) -> str:
        return "SpecCacheKVPrecompute"

    @property
    def engine(self) -> Any:
        return self._engine if self._engine is not None else self._llm.engine

    @property
    def last_summary(self) -> Optional[PrecomputeSummary]:
        """Remote precompute: what the last call did (new / already stored / failed)."""
        return getattr(self.engine, "last_precompute", None)

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        texts = [n.get_content(metadata_mode=self.metadata_mode).strip() for n in nodes]
        kept = [(t, n) for t, n in zip(texts, nodes) if t]
        vectors = None
        if self.neighbors:
            if any(n.embedding is None for _, n in kept):
                raise ValueError("SpecCacheKVPrecompute(neighbors=...) reads node.embedding: put the embedding "
                                 "model before it in the pipeline")
            vectors = [n.embedding for _, n in kept]
        texts, progress = [t for t, _ in kept], kwargs.get("show_progress", self.show_progress)
        if self._llm is None:
            precompute_texts(self._engine, texts, progress=progress, embeddings=vectors, neighbors=self.neighbors)
        else:       # with an engine too, the remote LLM checks that its server would read that engine's KV
            self._llm._precompute(texts, progress=progress, engine=self._engine, embeddings=vectors,
                                  neighbors=self.neighbors)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)
