"""Thin subclasses of vLLM's models (``plugin.ARCHITECTURES``) that record themselves when vLLM builds them.

The connector's worker side needs the model's submodules (embedding, per-layer norms, fused QKV,
rotary embedding, attention layer, MLP) to recompute a scattered subset of prompt tokens; vLLM
does not hand the model to a KV connector, so the model tells us itself. Behaviour is unchanged.
"""
from __future__ import annotations

import weakref

from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.phi3 import Phi3ForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

_LIVE: list[weakref.ref] = []


def _record(model) -> None:
    _LIVE[:] = [r for r in _LIVE if r() is not None]
    _LIVE.append(weakref.ref(model))


def current_model():
    """The most recently built (and still alive) recorded model of this process, or None."""
    for ref in reversed(_LIVE):
        model = ref()
        if model is not None:
            return model
    return None


class _Recorded:
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        _record(self)


class SpecCacheLlamaForCausalLM(_Recorded, LlamaForCausalLM):
    pass


class SpecCacheQwen2ForCausalLM(_Recorded, Qwen2ForCausalLM):
    pass


class SpecCacheQwen3ForCausalLM(_Recorded, Qwen3ForCausalLM):
    pass


class SpecCacheMistralForCausalLM(_Recorded, MistralForCausalLM):
    pass


class SpecCachePhi3ForCausalLM(_Recorded, Phi3ForCausalLM):
    pass


class SpecCacheGemma3ForCausalLM(_Recorded, Gemma3ForCausalLM):
    pass
