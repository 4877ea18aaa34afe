"""Model resolution and loading.

``resolve()`` turns a packaged model name (``"smollm2-135m"``), a Hugging Face model directory or a
``.gguf`` file into a local directory holding safetensors weights, a tokenizer and a config, ready
for ``AutoModelForCausalLM.from_pretrained``.  Packaged models ship as GGUF files (some split into
several packages); they are assembled, verified, de-quantized to float32 and converted to
safetensors *once*, into ``$SPECCACHE_HOME/models/<name>/`` (default: the platform's user cache
directory for ``speccache-rag``).  Later calls are cache hits that read nothing but a directory
listing.

``load()`` returns ``(model, tokenizer)`` for the runner, which supports the ``llama`` and ``qwen2``
architectures.

Weights are always converted to float32: the GGUF blocks de-quantize exactly to float32, and the
same converted weights are used for precompute and query, so cached KV stays exact.
"""
from .gguf import SOURCE_FILE, cache_home
from .load import load, load_tokenizer, resolve
from .registry import (PACKAGED, SUPPORTED_MODEL_TYPES, ModelFileError, ModelNotInstalled, PackagedModel,
                       install_command, is_installed)

__all__ = ["PACKAGED", "PackagedModel", "SUPPORTED_MODEL_TYPES", "ModelNotInstalled", "ModelFileError", "SOURCE_FILE",
           "cache_home", "install_command", "is_installed", "resolve", "load", "load_tokenizer"]
