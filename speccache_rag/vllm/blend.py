"""Worker side of the connector: blend one request's prompt KV with vLLM's own model modules.

This is :func:`speccache_rag.runner.run_layers` — the same loop, the same attention (torch SDPA,
causal by true position over a dense per-request cache), the same "write K/V before attending" rule
— expressed over vLLM's module layout (fused QKV, in-place rotary embedding, fused gate/up MLP).
Which tokens are recomputed comes from the core selection code; the dense result is then written
into vLLM's paged cache through the attention backend's own ``do_kv_cache_update`` (the CPU paged
layout is ISA-specific and is never indexed directly).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..config import ReuseConfig
from ..kv import ChunkKV, chunk_key
from ..prompt import RAGPrompt, Segment, TokenizedPrompt, render, tokenize_piece
from ..runner import KVCache
from ..selection import Selection, budget_for, top_positions
from ..selection.question_attention import question_probe, second_pass
from ..selection.static import epic_select, random_select
from ..selection.speculative import score, select_by_draft_scores, speculative_select

# Methods the vLLM worker can run ("oracle" needs a full target prefill with hidden-state capture
# through HF modules: analysis only, torch backend).
VLLM_METHODS = ("reuse", "epic", "cacheblend", "speccache", "qattn", "random")


class Unsupported(RuntimeError):
    """The model cannot be blended by this runner; the connector falls back to plain prefill."""


def check_model(model) -> None:
    """Raise Unsupported unless ``model`` has the llama/qwen2 layout the runner drives."""
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
        if getattr(attn, "qk_norm", False):
            raise Unsupported("QK-norm attention is not supported")
        windows = (getattr(attn.attn, "sliding_window", None), getattr(attn.attn.impl, "sliding_window", None))
        if any(w is not None and w not in (-1, (-1, -1)) for w in windows):   # -1: none (CPU backend)
            raise Unsupported("sliding-window attention is not supported")
        if getattr(attn.attn, "kv_sharing_target_layer_name", None):
            raise Unsupported("KV sharing across layers is not supported")


def dense_cache(model, capacity: int, keep_pre_rope: bool = False) -> KVCache:
    attn = model.model.layers[0].self_attn
    heads, dim = attn.attn.num_kv_heads, attn.attn.head_size
    dtype = model.model.embed_tokens.weight.dtype
    shape = (len(model.model.layers), heads, capacity, dim)
    k = torch.zeros(shape, dtype=dtype)
    return KVCache(k=k, v=torch.zeros_like(k), k_pre=torch.zeros_like(k) if keep_pre_rope else None)


def rotate(model, k_pre: torch.Tensor, positions: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """k_pre: [kv_heads, S, D] keys before RoPE → rotated to ``positions`` with the model's own rotary_emb.

    vLLM's rotary embedding takes (positions, query[, key]) flattened to [S, heads*D] and rotates in place.
    """
    heads, s, d = k_pre.shape
    flat = k_pre.transpose(0, 1).reshape(s, heads * d).contiguous()
    rotated, _ = model.model.layers[layer].self_attn.rotary_emb(positions, flat, None)
    return rotated.view(s, heads, d).transpose(0, 1)


def run_layers(model, cache: KVCache, h: torch.Tensor, positions: torch.Tensor, layers: range | None = None,
               capture: dict[int, torch.Tensor] | None = None, observe=None) -> torch.Tensor:
    """``runner.run_layers`` over vLLM modules: h [S, hidden] at sorted ``positions`` [S] → h after ``layers``."""
    blocks = model.model.layers
    layers = range(len(blocks)) if layers is None else layers
    num_keys = int(positions.max()) + 1
    mask = torch.arange(num_keys)[None, :] <= positions[:, None]           # [S, T]
    S = h.shape[0]
    for i in layers:
        layer = blocks[i]
        attn = layer.self_attn
        d = attn.attn.head_size
        x = layer.input_layernorm(h)
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = q.contiguous(), k.contiguous()
        if cache.k_pre is not None:
            cache.k_pre[i][:, positions] = k.view(S, -1, d).transpose(0, 1)
        q, k = attn.rotary_emb(positions, q, k)
        cache.k[i][:, positions] = k.view(S, -1, d).transpose(0, 1)
        cache.v[i][:, positions] = v.reshape(S, -1, d).transpose(0, 1)
        q = q.view(S, -1, d).transpose(0, 1)                                 # [H, S, D]
        if observe is not None:
            observe(i, q, cache.k[i, :, :num_keys])
        o = F.scaled_dot_product_attention(
            q[None], cache.k[i, :, :num_keys][None], cache.v[i, :, :num_keys][None],
            attn_mask=mask, scale=attn.scaling, enable_gqa=True)[0]          # [H, S, D]
        out, _ = attn.o_proj(o.transpose(0, 1).reshape(S, -1))
        h = h + out
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if capture is not None:
            capture[i] = h
    return h


def prefill(model, cache: KVCache, token_ids: torch.Tensor, positions: torch.Tensor, observe=None) -> None:
    if positions.numel():
        run_layers(model, cache, model.model.embed_tokens(token_ids), positions, observe=observe)


def chunk_kv_alone(model, sink_ids: list[int], ids: list[int], key: str, text: str) -> ChunkKV:
    """The torch engine's ``chunk_kv``: the chunk prefilled after the sink, keys before RoPE, sink dropped."""
    all_ids = torch.tensor(sink_ids + ids)
    cache = dense_cache(model, len(all_ids), keep_pre_rope=True)
    prefill(model, cache, all_ids, torch.arange(len(all_ids)))
    skip = len(sink_ids)
    return ChunkKV(key, list(ids), cache.k_pre[:, :, skip:].clone(), cache.v[:, :, skip:].clone(), meta={"text": text})


def write_paged(model, cache: KVCache, slots: torch.Tensor) -> None:
    """Write dense positions [0, len(slots)) of every layer into vLLM's paged cache."""
    n = slots.numel()
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn.attn
        k = cache.k[i, :, :n].transpose(0, 1).contiguous()                    # [T, kv_heads, D]
        v = cache.v[i, :, :n].transpose(0, 1).contiguous()
        attn.impl.do_kv_cache_update(attn, k, v, attn.kv_cache, slots)


def slot_mapping(block_ids: list[int], block_size: int, n: int) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.as_tensor(block_ids, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


# ---- segments ------------------------------------------------------------------------------------
def _piece(tokenizer, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """Text of a token run and each token's character span in it."""
    text = tokenizer.decode(ids)
    again, offsets = tokenize_piece(tokenizer, text)
    if again == ids:
        return text, offsets
    offsets, prev = [], 0                                # incremental decode: exact spans for any run
    for j in range(len(ids)):
        end = len(tokenizer.decode(ids[: j + 1]))
        offsets.append((min(prev, end), end))
        prev = end
    return text, offsets


def segments_from_spans(tokenizer, token_ids: list[int], spans: list[tuple[int, int]]) -> TokenizedPrompt:
    """A TokenizedPrompt over arbitrary prompt tokens: ``spans`` are the chunks, the rest template text."""
    segs, cursor = [], 0
    for idx, (s, e) in enumerate(spans):
        if s > cursor:
            text, off = _piece(tokenizer, token_ids[cursor:s])
            segs.append(Segment(cursor, s, text, None, off))
        text, off = _piece(tokenizer, token_ids[s:e])
        segs.append(Segment(s, e, text, idx, off))
        cursor = e
    if cursor < len(token_ids):
        text, off = _piece(tokenizer, token_ids[cursor:])
        segs.append(Segment(cursor, len(token_ids), text, None, off))
    return TokenizedPrompt(list(token_ids), segs)


def draft_view(target_tokens: TokenizedPrompt, draft_tokenizer) -> TokenizedPrompt:
    """The prompt as the draft reads it when no RAGPrompt is known: every target segment's text
    tokenized by the draft on its own, so chunk boundaries (and char offsets) line up."""
    ids, segs = [], []
    for seg in target_tokens.segments:
        piece, off = tokenize_piece(draft_tokenizer, seg.text)
        segs.append(Segment(len(ids), len(ids) + len(piece), seg.text, seg.chunk, off))
        ids.extend(piece)
    return TokenizedPrompt(ids, segs)


def speculative_select_view(sel: Selection, draft_tokens: TokenizedPrompt, draft) -> torch.Tensor:
    """``speculative_select`` for a prompt known only as tokens: the same core steps (score, then
    ``select_by_draft_scores``: spans, budget, map) over :func:`draft_view` instead of the draft's
    own chat template."""
    return select_by_draft_scores(sel, draft_tokens, score(draft, draft_tokens, sel.config.draft_layers))


# ---- one request ---------------------------------------------------------------------------------
@dataclass
class BlendReport:
    """Per-request statistics, named as in ``GenerationStats``."""

    method: str
    prompt_tokens: int
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    load_s: float = 0.0
    draft_s: float = 0.0
    recompute_s: float = 0.0
    fill_s: float = 0.0
    stored: list[str] = field(default_factory=list)

    def line(self) -> str:
        share = self.recomputed_tokens / max(1, self.prompt_tokens)
        return (f"method={self.method} prompt={self.prompt_tokens} reused={self.reused_tokens} "
                f"recomputed={self.recomputed_tokens} ({share:.1%}) hits={self.cache_hits} misses={self.cache_misses} "
                f"load={self.load_s:.3f}s draft={self.draft_s:.3f}s recompute={self.recompute_s:.3f}s"
                + (f" stored={len(self.stored)} fill={self.fill_s:.3f}s" if self.stored else ""))


class Blender:
    """Everything one worker needs to blend requests: model, tokenizers, store, draft, fingerprint."""

    def __init__(self, model, tokenizer, store, fingerprint: str, sink_ids: list[int], draft_loader,
                 fill_misses: bool = True):
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.fingerprint, self.sink_ids = fingerprint, sink_ids
        self._draft_loader, self._draft = draft_loader, None
        self.fill_misses = fill_misses

    @property
    def draft(self):
        if self._draft is None:
            self._draft = self._draft_loader()
        return self._draft

    @torch.inference_mode()
    def blend(self, token_ids: list[int], spans: list, reuse: ReuseConfig,
              slots: torch.Tensor, prompt: RAGPrompt | None = None, precompute: bool = False) -> BlendReport:
        """Fill the paged cache for prompt positions [0, len(slots)) (all but the last token, which vLLM computes).

        spans: [start, end] per chunk, or [start, end, key] when the scheduler found it in the store
        (then [start, end) may be a prefix of that entry's tokens).
        """
        n, m = len(token_ids), slots.numel()
        keys = {int(sp[0]): sp[2] for sp in spans if len(sp) > 2}
        spans = [(int(sp[0]), int(sp[1])) for sp in spans]
        report = BlendReport(method="precompute" if precompute else reuse.method, prompt_tokens=n)
        tokens = None
        if prompt is not None:
            rendered = render(prompt, self.tokenizer)
            if rendered.token_ids == list(token_ids):
                tokens = rendered                                  # the torch engine's exact segments
            else:
                prompt = None                                      # not this prompt's text: use the spans
        if tokens is None:
            tokens = segments_from_spans(self.tokenizer, list(token_ids), spans)
        cache = dense_cache(self.model, m, keep_pre_rope=precompute)

        t = time.perf_counter()
        reusable = torch.zeros(n, dtype=torch.bool)
        missed: list[Segment] = []
        for seg in tokens.chunk_segments():
            ids = tokens.token_ids[seg.start:seg.end]
            key = keys.get(seg.start) or chunk_key(self.fingerprint, ids)
            entry = None if precompute else self.store.get(key)
            L = len(ids)
            if entry is None or entry.token_ids[:L] != ids or seg.end > m:
                report.cache_misses += 1
                missed.append(seg)
                continue
            report.cache_hits += 1
            positions = torch.arange(seg.start, seg.end)
            for i in range(cache.k.shape[0]):
                cache.k[i, :, seg.start:seg.end] = rotate(self.model, entry.k[i, :, :L].to(cache.k.dtype), positions, i)
                cache.v[i, :, seg.start:seg.end] = entry.v[i, :, :L].to(cache.v.dtype)
            reusable[seg.start:seg.end] = True
        report.load_s = time.perf_counter() - t

        always = (~reusable).nonzero().flatten()
        sel = Selection(tokens, reusable, budget_for(reuse.recompute_ratio, int(reusable.sum())), reuse)
        ids_t = torch.as_tensor(tokens.token_ids, dtype=torch.long)
        t = time.perf_counter()
        if reuse.method == "cacheblend" and not precompute and reusable.any():
            recomputed = self._cacheblend(cache, sel, always, ids_t, m)
            report.recompute_s = time.perf_counter() - t
        elif reuse.method == "qattn" and not precompute and sel.budget:
            recomputed = self._qattn(cache, sel, always, ids_t, m)
            report.recompute_s = time.perf_counter() - t
        else:
            chosen = self._select(sel, prompt, tokens) if not precompute else torch.empty(0, dtype=torch.long)
            report.draft_s = time.perf_counter() - t
            t = time.perf_counter()
            recomputed = torch.cat([chosen, always]).unique()
            inside = recomputed[recomputed < m]
            prefill(self.model, cache, ids_t[inside], inside)
            report.recompute_s = time.perf_counter() - t
        write_paged(self.model, cache, slots)
        report.recomputed_tokens = int(recomputed.numel())
        report.reused_tokens = n - report.recomputed_tokens

        if precompute or self.fill_misses:
            t = time.perf_counter()
            for seg in missed:
                ids = tokens.token_ids[seg.start:seg.end]
                key = chunk_key(self.fingerprint, ids)
                if precompute and seg.start == len(self.sink_ids) and seg.end <= m \
                        and tokens.token_ids[:seg.start] == self.sink_ids:
                    # the precompute prompt is [sink] + chunk + one token: its KV is the chunk's alone
                    entry = ChunkKV(key, ids, cache.k_pre[:, :, seg.start:seg.end].clone(),
                                    cache.v[:, :, seg.start:seg.end].clone(), meta={"text": seg.text})
                elif self.store.contains(key):
                    continue
                else:
                    entry = chunk_kv_alone(self.model, self.sink_ids, ids, key, seg.text)
                self.store.put(entry)
                report.stored.append(key)
            report.fill_s = time.perf_counter() - t
        return report

    def _select(self, sel: Selection, prompt: RAGPrompt | None, tokens: TokenizedPrompt) -> torch.Tensor:
        method = sel.config.method
        if method == "reuse" or sel.budget == 0:
            return torch.empty(0, dtype=torch.long)
        if method == "epic":
            return epic_select(sel)
        if method == "random":
            return random_select(sel)
        if method == "speccache":
            draft, draft_tokenizer = self.draft
            if prompt is not None:                                  # rendered exactly as the torch engine does
                sel.prompt, sel.draft, sel.draft_tokenizer = prompt, draft, draft_tokenizer
                return speculative_select(sel)
            return speculative_select_view(sel, draft_view(tokens, draft_tokenizer), draft)
        raise ValueError(f"method {method!r} is not available in the vLLM backend ({', '.join(VLLM_METHODS)})")

    def _cacheblend(self, cache: KVCache, sel: Selection, always: torch.Tensor, ids: torch.Tensor, m: int):
        """``selection.cacheblend_prefill`` over vLLM modules (layers 0..c over every token, then the top set)."""
        layers = len(self.model.model.layers)
        c = min(sel.config.cacheblend_check_layer, layers - 1)
        everything = torch.arange(m)
        v_cached = cache.v[c, :, :m].clone()
        h = run_layers(self.model, cache, self.model.model.embed_tokens(ids[:m]), everything, layers=range(c + 1))
        deviation = torch.zeros(len(sel.tokens))
        deviation[:m] = (cache.v[c, :, :m] - v_cached).pow(2).sum(dim=(0, 2))
        chosen = top_positions(deviation, sel.reusable_positions, sel.budget)
        keep = torch.cat([chosen, always]).unique()
        inside = keep[keep < m]
        if inside.numel():
            run_layers(self.model, cache, h[inside], inside, layers=range(c + 1, layers))
        return keep

    def _qattn(self, cache: KVCache, sel: Selection, always: torch.Tensor, ids: torch.Tensor, m: int):
        """``selection.question_attention.qattn_prefill`` over vLLM modules, for positions [0, m)."""
        inside = always[always < m]
        probe = question_probe(self.model, sel, inside)
        prefill(self.model, cache, ids[inside], inside, observe=probe)
        chosen, again = second_pass(probe, sel, inside)
        prefill(self.model, cache, ids[again], again)
        return torch.cat([chosen, always]).unique()


__all__ = ["Blender", "BlendReport", "Unsupported", "VLLM_METHODS", "check_model", "slot_mapping"]
