"""The ``vllm.general_plugins`` entry point (pyproject: ``speccache = "speccache_rag.vllm.plugin:register"``).

vLLM calls it in every process it starts (API server, engine core, workers), possibly more than
once, so it must be idempotent and cheap: it registers the model subclasses of :mod:`.models` lazily
(by "module:Class" string), which import nothing until vLLM builds the model.
"""
from __future__ import annotations

# vLLM architecture name → our subclass, for the architectures the connector's runner supports.
ARCHITECTURES = {
    "LlamaForCausalLM": "SpecCacheLlamaForCausalLM",
    "Qwen2ForCausalLM": "SpecCacheQwen2ForCausalLM",
    "Qwen3ForCausalLM": "SpecCacheQwen3ForCausalLM",
    "MistralForCausalLM": "SpecCacheMistralForCausalLM",
    "Phi3ForCausalLM": "SpecCachePhi3ForCausalLM",
    "Gemma3ForCausalLM": "SpecCacheGemma3ForCausalLM",
}
MODULE = "speccache_rag.vllm.models"


def register() -> None:
    from vllm import ModelRegistry

    for arch, cls in ARCHITECTURES.items():
        current = ModelRegistry.models.get(arch)
        if getattr(current, "module_name", None) == MODULE and getattr(current, "class_name", None) == cls:
            continue                                            # already ours: nothing to do
        ModelRegistry.register_model(arch, f"{MODULE}:{cls}")
