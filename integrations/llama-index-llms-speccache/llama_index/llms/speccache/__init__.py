"""LlamaIndex integration of speccache-rag: a drop-in ``LLM`` that reuses precomputed chunk KV, and an
``IngestionPipeline`` step that precomputes it.

```python
from llama_index.llms.speccache import SpecCacheLLM, SpecCacheKVPrecompute
```
"""
try:
    import llama_index.core  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "llama_index.llms.speccache needs LlamaIndex: pip install llama-index-llms-speccache"
    ) from e

from llama_index.llms.speccache.base import SpecCacheLLM
from llama_index.llms.speccache.hints import RetrievalHints
from llama_index.llms.speccache.precompute import SpecCacheKVPrecompute

__all__ = ["SpecCacheLLM", "SpecCacheKVPrecompute", "RetrievalHints"]
