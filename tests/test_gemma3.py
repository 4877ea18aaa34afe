"""Gemma-3-270M, real weights: sliding-window and global layers, QK-norm, sandwich norms, per-type rope bases.

The prompt (~610 tokens) is longer than the model's 512-token window, so its sliding layers attend within the
window by true position while its global layers see everything — in full prefill and in every blend.
"""
import pytest
import torch

from speccache_rag import RAGPrompt, ReuseConfig, SpecCacheEngine
from speccache_rag.config import METHODS
from speccache_rag.gate import logits_mismatch
from test_exactness import CHUNKS, QUESTION


@pytest.fixture(scope="module")
def gemma():
    from speccache_rag.models import load

    model, tok = load("gemma3-270m", dtype="float32")
    engine = SpecCacheEngine(model, tok, store="memory://")
    chunks = CHUNKS * 4
    engine.precompute(chunks)
    prompt = RAGPrompt(chunks=chunks, question=QUESTION)
    full = engine.generate(prompt, max_new_tokens=8, reuse=ReuseConfig(method="full"), return_first_logits=True)
    yield engine, prompt, full
    engine.close()


def test_the_prompt_crosses_the_sliding_window(gemma):
    engine, _, full = gemma
    cfg = engine.target.config
    assert "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    assert full.stats.prompt_tokens > cfg.sliding_window


@pytest.mark.parametrize("method", [m for m in METHODS if m != "reuse"])
def test_every_method_at_ratio_one_equals_full_prefill(gemma, method):
    engine, prompt, full = gemma
    out = engine.generate(prompt, max_new_tokens=8, reuse=ReuseConfig(method=method, recompute_ratio=1.0),
                          return_first_logits=True)
    assert out.stats.reused_tokens == 0 and out.token_ids == full.token_ids
    assert logits_mismatch(out.first_logits, full.first_logits, torch.float32) is None


def test_the_default_reuses_stored_chunks_and_moves_toward_full(gemma):
    engine, prompt, full = gemma
    reuse = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method="reuse"), return_first_logits=True)
    out = engine.generate(prompt, max_new_tokens=1, return_first_logits=True)
    assert reuse.stats.cache_hits == len(prompt.chunks) and reuse.stats.reused_tokens > 0
    assert 0 < out.stats.recomputed_tokens < out.stats.prompt_tokens

    def kl(other):
        return float(torch.nn.functional.kl_div(other.first_logits.log_softmax(-1), full.first_logits.log_softmax(-1),
                                                log_target=True, reduction="sum"))
    assert kl(reuse) > 1e-3                      # stitched chunks alone are not full prefill …
    assert kl(out) < kl(reuse)                   # … and the default's recompute brings the first token closer
    # with QK-norm the stale tokens keep their stored KV: propagation moved this prompt away from full
    plain = engine.generate(prompt, max_new_tokens=1, return_first_logits=True, reuse=ReuseConfig(propagate=0.0))
    assert torch.equal(out.first_logits, plain.first_logits)


def test_one_layer_rotates_with_its_own_rope_base(gemma):
    """``rotate(..., first_layer=i)`` (propagate.py corrects one layer's keys at a time) uses layer i's rope type."""
    engine, _, _ = gemma
    ops = engine.ops
    k = torch.randn(1, ops.num_kv_heads, 5, ops.head_dim).expand(ops.num_layers, -1, -1, -1)  # alike in every layer
    positions = torch.arange(700, 705)
    every = ops.rotate(k, positions)
    types = engine.target.config.layer_types
    for i in (types.index("sliding_attention"), types.index("full_attention")):
        torch.testing.assert_close(ops.rotate(k[i:i + 1], positions, first_layer=i)[0], every[i])
    assert not torch.allclose(every[types.index("sliding_attention")], every[types.index("full_attention")])  # two bases
