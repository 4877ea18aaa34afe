"""speccache-rag: reuse precomputed chunk KV caches in RAG, repaired by speculative token selection."""
from .config import GenerationConfig, OffloadConfig, ReuseConfig, StoreConfig
from .engine import SpecCacheEngine
from .engines import open_engine
from .output import GenerationOutput, GenerationStats, GenerationStream, OffloadStats
from .prompt import RAGPrompt

__all__ = ["SpecCacheEngine", "open_engine", "RAGPrompt", "ReuseConfig", "OffloadConfig", "GenerationConfig", "StoreConfig",
           "GenerationOutput", "GenerationStats", "GenerationStream", "OffloadStats"]
__version__ = "0.1.0"
