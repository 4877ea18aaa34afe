"""speccache-rag: reuse precomputed chunk KV caches in RAG, repaired by speculative token selection.

The remote client (``open_engine(..., backend="remote")``, both drop-ins in remote mode) needs neither torch nor
transformers; the in-process engines do (``pip install 'speccache-rag[local]'``). So the names below are
resolved on first use, and importing the package loads no model code.
"""
from __future__ import annotations

_EXPORTS = {
    "SpecCacheEngine": ".engine", "open_engine": ".engines", "RAGPrompt": ".prompt", "ReuseConfig": ".config",
    "OffloadConfig": ".config", "GenerationConfig": ".config", "StoreConfig": ".config",
    "GenerationOutput": ".output", "GenerationStats": ".output", "GenerationStream": ".output",
    "OffloadStats": ".output",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'speccache_rag' has no attribute {name!r}")
    from .engines import import_local

    value = getattr(import_local(__name__ + _EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
