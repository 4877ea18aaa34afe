"""speccache-rag: reuse precomputed chunk KV caches in RAG, repaired by speculative token selection."""
from .config import GenerationConfig, ReuseConfig, StoreConfig
from .engine import SpecCacheEngine
from .output import GenerationOutput, GenerationStats, GenerationStream
from .prompt import RAGPrompt

__all__ = ["SpecCacheEngine", "RAGPrompt", "ReuseConfig", "GenerationConfig", "StoreConfig",
           "GenerationOutput", "GenerationStats", "GenerationStream"]
__version__ = "0.1.0"
