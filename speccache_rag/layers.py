"""Layer operations: the few model-specific steps the runner drives, for HF llama/qwen2/qwen3/mistral/phi3/gemma3
modules.

:func:`speccache_rag.runner.run_layers` is the one layer loop and the one attention (SDPA, causal by
true position, K/V written before attending). What differs between model implementations — where
the projections live, how RoPE is applied, the MLP — sits behind :class:`LayerOps`. This module
holds the HF adapter; ``speccache_rag.vllm.layers`` holds vLLM's. Keys are rotated with the model's
own rotary embedding, so every rope variant a checkpoint declares (llama3, yarn, linear, Gemma 3's local
and global bases) is kept.
"""
from __future__ import annotations

import inspect
from typing import Protocol

import torch

from .models.registry import SUPPORTED_MODEL_TYPES as SUPPORTED_ARCHS


class LayerOps(Protocol):
    """A decoder-only model as the runner sees it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device            # where the model's weights are: every tensor the pipeline makes goes there
    scaling: float                  # softmax scale of the attention
    windows: list[int | None]       # per layer: sliding window (a key is seen within that many positions) or None
    qk_norm: bool                   # per-head RMSNorm of q and k before RoPE (qwen3, gemma3)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[S] → residual stream [S, hidden]."""

    def rope(self, positions: torch.Tensor, like: torch.Tensor):
        """Whatever ``attention_inputs`` needs to rotate at ``positions`` (computed once per pass)."""

    def attention_inputs(self, layer: int, h: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        """h [S, hidden] → q [H, S, D] rotated, k before RoPE, k rotated, v (each [KVH, S, D])."""

    def attention_output(self, layer: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual h [S, hidden] and attention o [S, H*D] → the layer's output residual (o_proj, MLP)."""

    def logits(self, h_last: torch.Tensor) -> torch.Tensor | None:
        """Residual of the last token [hidden] → next-token logits [vocab] in float32."""

    def rotate(self, k_pre: torch.Tensor, positions: torch.Tensor, first_layer: int = 0, rope=None) -> torch.Tensor:
        """Keys before RoPE [layers, KVH, S, D] of layers ``first_layer``.. → rotated to ``positions`` [S];
        ``rope``: ``rope(positions, …)``'s result, for a caller that rotates to the same positions again and again."""


def check_arch(model) -> None:
    cfg = model.config
    if cfg.model_type not in SUPPORTED_ARCHS:
        raise ValueError(f"architecture {cfg.model_type!r} is not supported by the runner "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise ValueError("attention logit soft-capping (Gemma 2) is not supported by the runner")


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window, as the config's ``layer_types`` mark it (Gemma 3, Qwen with
    ``use_sliding_window``); None where a layer attends to every earlier position."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [config.sliding_window if t == "sliding_attention" else None for t in types]


def attention_span(config) -> int:
    """The longest prompt the runner reproduces exactly: a window every layer shares (Mistral's and Phi-3's
    ``sliding_window``, which their configs do not mark per layer) bounds it, since within it a windowed layer
    attends to everything, as full prefill."""
    span = config.max_position_embeddings
    if config.model_type in ("mistral", "phi3") and getattr(config, "sliding_window", None):
        span = min(span, config.sliding_window)
    return span


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., S, head_dim]; cos, sin: [S, rotary dims] — fewer than head_dim under a partial rotary factor
    (phi3 variants), whose remaining dims pass unrotated."""
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :d], cos, sin), x[..., d:]], dim=-1)
    return x * cos + rotate_half(x) * sin


class HFLayers:
    """LayerOps over a transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
    ``MistralForCausalLM``, ``Phi3ForCausalLM`` or ``Gemma3ForCausalLM``."""

    def __init__(self, model):
        check_arch(model)
        cfg = model.config
        self.model = model
        self.blocks = model.model.layers
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.scaling = self.blocks[0].self_attn.scaling
        self.windows = layer_windows(cfg)
        self.qk_norm = hasattr(self.blocks[0].self_attn, "q_norm")
        self.fused_qkv = hasattr(self.blocks[0].self_attn, "qkv_proj")
        # Gemma 3: each layer type has its own rotary base, and norms sit on both sides of attention and MLP
        rotary = model.model.rotary_emb
        self.rope_types = (list(cfg.layer_types) if "layer_type" in inspect.signature(rotary.forward).parameters
                           else None)
        self.sandwich_norms = hasattr(self.blocks[0], "pre_feedforward_layernorm")
        self.logit_cap = getattr(cfg, "final_logit_softcapping", None)
        kv = self.num_kv_heads * self.head_dim
        self.qkv_sizes = [cfg.num_attention_heads * self.head_dim, kv, kv]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(token_ids)

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (cos, sin) [S, D] each; layers of one rope type share one pair."""
        rotary = self.model.model.rotary_emb
        if self.rope_types is None:
            cos, sin = rotary(like, positions[None])                          # [1, S, D] each
            return [(cos[0], sin[0])] * self.num_layers
        pairs = {t: tuple(x[0] for x in rotary(like, positions[None], t)) for t in set(self.rope_types)}
        return [pairs[t] for t in self.rope_types]

    def attention_inputs(self, layer: int, h: torch.Tensor, rope):
        block, S = self.blocks[layer], h.shape[0]
        attn = block.self_attn
        x = block.input_layernorm(h)
        if self.fused_qkv:                          # phi3: one projection, split as HF does
            q, k, v = attn.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q, k = q.view(S, -1, self.head_dim), k.view(S, -1, self.head_dim)
        if self.qk_norm:                            # qwen3: per-head RMSNorm of q and k, before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(0, 1), k.transpose(0, 1)
        v = v.view(S, -1, self.head_dim).transpose(0, 1)
        return apply_rope(q, *rope[layer]), k, apply_rope(k, *rope[layer]), v

    def attention_output(self, layer: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        block = self.blocks[layer]
        if self.sandwich_norms:
            h = h + block.post_attention_layernorm(block.self_attn.o_proj(o))
            return h + block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(h)))
        h = h + block.self_attn.o_proj(o)
        return h + block.mlp(block.post_attention_layernorm(h))

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(self.model.model.norm(h_last)).float()
        return logits if not self.logit_cap else torch.tanh(logits / self.logit_cap) * self.logit_cap

    def rotate(self, k_pre: torch.Tensor, positions: torch.Tensor, first_layer: int = 0, rope=None) -> torch.Tensor:
        ropes = rope if rope is not None else self.rope(positions, k_pre)
        if self.rope_types is None:
            return apply_rope(k_pre, *ropes[0])
        return torch.stack([apply_rope(k, *cs) for k, cs in zip(k_pre, ropes[first_layer:])])
