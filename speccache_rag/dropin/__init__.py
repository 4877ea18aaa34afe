"""What the framework drop-ins (``integrations/``: LangChain's ``ChatSpecCache``, LlamaIndex's
``SpecCacheLLM``) share, so that each is only a translation of its framework's API: ``core`` (their
settings with the defaults and checks, the engine, the calls, precompute), ``fields`` (those settings as
the pydantic fields both declare; imported by the drop-ins only), ``generate`` (generation from a prompt
string or chat messages) and ``hints`` (the texts of recent retrievals)."""
from .core import (DropIn, DropInSettings, cached_tokens, init_arguments, needs_server, precompute_texts, store_name,
                   usage)
from .generate import agenerate_text, astream_text, generate_text, stream_text
from .hints import RecentRetrievals

__all__ = ["DropIn", "DropInSettings", "init_arguments", "needs_server", "store_name", "usage", "cached_tokens",
           "precompute_texts", "generate_text", "agenerate_text", "stream_text", "astream_text", "RecentRetrievals"]
