"""SpeCache offloaded decoding: the full KV off the accelerator, a low-bit copy resident, top-k prefetch."""
from .decode import OffloadDecoder, OffloadStats

__all__ = ["OffloadDecoder", "OffloadStats"]
