"""Thin subclasses of vLLM's llama / qwen2 models that record themselves when vLLM builds them.

The connector's worker side needs the model's submodules (embedding, per-layer norms, fused QKV,
rotary embedding, attention layer, MLP) to recompute a scattered subset of prompt tokens; vLLM
does not hand the model to a KV connector, so the model tells us itself. Behaviour is unchanged.
"""
from __future__ import annotations

import weakref

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

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


class SpecCacheLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        _record(self)


class SpecCacheQwen2ForCausalLM(Qwen2ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        _record(self)
