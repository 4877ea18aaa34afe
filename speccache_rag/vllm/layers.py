"""LayerOps over vLLM's llama / qwen2 / qwen3 / mistral / phi3 / gemma3 modules, and the copy of a dense cache into
vLLM's paged one.

The runner (:mod:`speccache_rag.runner`) drives these exactly as it drives HF's: fused QKV, per-head q/k norms
where the model has them, vLLM's rotary embedding of each layer (which rotates in place, so what it is given is
always a copy: of the fresh keys, whose pre-RoPE form the cache keeps, and of stored keys), each layer's
sliding window as its attention backend holds it, fused gate/up MLP, Gemma's norms on both sides. The blended
cache is written into vLLM's paged blocks through the attention backend's own ``do_kv_cache_update``: the CPU
paged layout is ISA-specific and is never indexed directly.
"""
from __future__ import annotations

import torch

from ..runner import KVCache


class Unsupported(RuntimeError):
    """The model cannot be blended by this runner; the connector falls back to plain prefill."""


def check_model(model) -> None:
    """Raise Unsupported unless ``model`` has a layout the runner drives."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_tokens"):
        raise Unsupported(f"{type(model).__name__} has no model.layers / model.embed_tokens")
    if getattr(inner, "start_layer", 0) != 0 or getattr(inner, "end_layer", len(layers)) != len(layers):
        raise Unsupported("pipeline parallelism is not supported")
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            if not hasattr(layer, name):
                raise Unsupported(f"decoder layer without {name}")
        for name in ("qkv_proj", "o_proj", "rotary_emb", "attn", "q_size", "kv_size", "scaling"):
            if not hasattr(attn, name):
                raise Unsupported(f"attention without {name}")
        if getattr(attn, "do_llama_4_scaling", False) or getattr(layer, "ada_rms_norm_t_cond", None) is not None:
            raise Unsupported("position-dependent attention scaling and conditioned norms are not supported")
        if getattr(attn.attn.impl, "logits_soft_cap", 0):
            raise Unsupported("attention logit soft-capping is not supported")
        if getattr(attn.attn, "kv_sharing_target_layer_name", None):
            raise Unsupported("KV sharing across layers is not supported")


def _window(attn) -> int | None:
    w = getattr(attn.attn.impl, "sliding_window", None)
    if isinstance(w, tuple):                # (left, right) in the GPU backends: left + the query itself; -1: none
        w = None if w[0] < 0 else w[0] + 1
    return None if w is None or w < 0 else int(w)


class VllmLayers:
    """LayerOps over the vLLM models of :data:`speccache_rag.vllm.plugin.ARCHITECTURES` (checked by
    :func:`check_model`)."""

    def __init__(self, model):
        check_model(model)
        self.model = model
        self.blocks = model.model.layers
        attn = self.blocks[0].self_attn
        self.num_layers = len(self.blocks)
        self.num_kv_heads, self.head_dim = attn.attn.num_kv_heads, attn.attn.head_size
        self.dtype = model.model.embed_tokens.weight.dtype
        self.device = model.model.embed_tokens.weight.device
        self.scaling = attn.scaling
        self.windows = [_window(b.self_attn) for b in self.blocks]
        self.qk_norm = hasattr(attn, "q_norm")
        self.sandwich_norms = hasattr(self.blocks[0], "pre_feedforward_layernorm")

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_input_ids(token_ids)         # Gemma scales the embedding here

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return positions                        # vLLM's rotary embedding takes the positions themselves

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1, self.head_dim).transpose(0, 1)        # [S, n*D] → [n, S, D]

    def attention_inputs(self, layer: int, h: torch.Tensor, rope):
        block = self.blocks[layer]
        attn = block.self_attn
        qkv, _ = attn.qkv_proj(block.input_layernorm(h))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        if self.qk_norm:                            # per head, before RoPE
            q = attn.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
            k = attn.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        k_pre = k.contiguous()
        q, k = attn.rotary_emb(rope, q.contiguous(), k_pre.clone())
        return self._heads(q), self._heads(k_pre), self._heads(k), self._heads(v.contiguous())

    def attention_output(self, layer: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        block = self.blocks[layer]
        out, _ = block.self_attn.o_proj(o)
        if self.sandwich_norms:
            h = h + block.post_attention_layernorm(out)
            return h + block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(h)))
        h = h + out
        return h + block.mlp(block.post_attention_layernorm(h))

    def logits(self, h_last: torch.Tensor) -> None:
        return None                             # vLLM computes the prompt's last token and samples it itself

    def rotate(self, k_pre: torch.Tensor, positions: torch.Tensor, first_layer: int = 0, rope=None) -> torch.Tensor:
        # ``rope`` would be ``positions`` again (``self.rope``): vLLM's rotary embedding computes from those
        layers, heads, s, d = k_pre.shape
        out = torch.empty_like(k_pre)
        for i in range(layers):
            flat = k_pre[i].transpose(0, 1).reshape(s, heads * d).clone()   # rotated in place: never the stored entry
            rotated, _ = self.blocks[first_layer + i].self_attn.rotary_emb(positions, flat, None)
            out[i] = rotated.view(s, heads, d).transpose(0, 1)
        return out


def write_paged(ops: VllmLayers, cache: KVCache, slots: torch.Tensor) -> None:
    """Write dense positions [0, len(slots)) of every layer into vLLM's paged cache."""
    n = slots.numel()
    for i, block in enumerate(ops.blocks):
        attn = block.self_attn.attn
        k = cache.k[i, :, :n].transpose(0, 1).contiguous()                    # [T, kv_heads, D]
        v = cache.v[i, :, :n].transpose(0, 1).contiguous()
        attn.impl.do_kv_cache_update(attn, k, v, attn.kv_cache, slots)


def slot_mapping(block_ids: list[int], block_size: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The paged-cache slot of each of the first ``n`` prompt positions, on the worker's ``device``."""
    pos = torch.arange(n, device=device)
    return torch.as_tensor(block_ids, dtype=torch.long, device=device)[pos // block_size] * block_size + pos % block_size
