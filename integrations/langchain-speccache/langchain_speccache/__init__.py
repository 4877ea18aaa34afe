"""LangChain integration of speccache-rag: ``ChatSpecCache``, a chat model that reuses precomputed
chunk KV, with a retriever callback that passes hints and a document precompute step.

```python
from langchain_speccache import ChatSpecCache
```
"""
try:
    import langchain_core  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("langchain_speccache needs LangChain: pip install langchain-speccache") from e

from langchain_speccache.callbacks import RetrievalHints
from langchain_speccache.chat_models import ChatSpecCache
from langchain_speccache.document_transformers import SpecCachePrecompute

__all__ = ["ChatSpecCache", "RetrievalHints", "SpecCachePrecompute"]
