"""The guard: with every token recomputed, each method equals full prefill; with none, it does not."""
import pytest
import torch
import torch.nn.functional as F

from speccache_rag import RAGPrompt, ReuseConfig, SpecCacheEngine
from speccache_rag.layers import HFLayers
from speccache_rag.prompt import render
from speccache_rag.runner import KVCache, decode_one, full_prefill, prefill
from tiny_models import tiny_random_model

ALL_BUT_REUSE = ["full", "epic", "cacheblend", "speccache", "norm", "qattn", "random", "oracle"]

CHUNKS = [
    "Zorblat Industries was founded in 1987 by Mira Quell in the town of Vessendorf. The company makes "
    "copper kettles, employs 240 people and exports most of its output to Denmark.",
    "Mira Quell was born in 1950 in Ostrava. She studied metallurgy, worked in a foundry for twelve years "
    "and later moved to Vessendorf, where she opened a small workshop.",
    "Vessendorf is a small town on the river Lenne, known for its annual kettle festival held every "
    "August. The festival draws about nine thousand visitors.",
    "The Lenne rises in the hills north of Vessendorf and joins a larger river after sixty kilometres.",
]
QUESTION = "In which year was the founder of Zorblat Industries born?"


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_runner_matches_transformers(arch):
    model, _ = tiny_random_model(arch, tokenizer=_FakeTok())
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
        ref_next = model(torch.cat([ids, torch.tensor([7])])[None]).logits[0, -1]
    ops = HFLayers(model)
    cache, last = full_prefill(ops, ids, capacity=41)
    torch.testing.assert_close(last, ref[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode_one(ops, cache, 7, 40), ref_next, atol=1e-5, rtol=1e-5)


def test_blend_of_scattered_subset_is_causal_by_true_position():
    """Recomputing positions {0..9} ∪ {20..29} over a cache whose other entries are exact gives exact logits."""
    model, _ = tiny_random_model("llama", tokenizer=_FakeTok())
    ids = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(1))
    ops = HFLayers(model)
    exact, ref = full_prefill(ops, ids)
    cache = KVCache(exact.k.clone(), exact.v.clone())
    subset = torch.cat([torch.arange(0, 10), torch.arange(20, 30)])
    cache.k[:, :, subset] = 0
    cache.v[:, :, subset] = 0
    out = prefill(ops, cache, ids[subset], subset)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.k, exact.k, atol=1e-5, rtol=1e-5)


def test_rotating_pre_rope_keys_equals_model_keys_at_position(smollm2):
    """A chunk's stored pre-RoPE keys, rotated to p.., equal the model's own keys for it at p.."""
    model, tok = smollm2
    ids = torch.tensor(tok(CHUNKS[0], add_special_tokens=False)["input_ids"])
    ops = HFLayers(model)
    stored, _ = full_prefill(ops, ids, keep_pre_rope=True)
    p = 137
    with torch.no_grad():
        past = model(ids[None], position_ids=torch.arange(p, p + len(ids))[None], use_cache=True).past_key_values
    for layer in (0, model.config.num_hidden_layers // 2, model.config.num_hidden_layers - 1):
        rotated = ops.rotate(stored.k_pre[layer], torch.arange(p, p + len(ids)))
        torch.testing.assert_close(rotated, past.layers[layer].keys[0], atol=2e-4, rtol=1e-4)
    # and the rotation is not a no-op: position 0 keys differ from position p keys
    assert (ops.rotate(stored.k_pre[0], torch.arange(len(ids))) - past.layers[0].keys[0]).abs().max() > 1e-2


# First-token logits of r = 1 against full, per compute dtype: the criterion the correctness gate uses.
from speccache_rag.gate import logits_mismatch  # noqa: E402


def assert_reproduces(logits, ref, dtype):
    wrong = logits_mismatch(logits, ref, dtype)
    assert wrong is None, wrong


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def engine(request, smollm2, smollm2_bf16):
    model, tok = smollm2 if request.param == torch.float32 else smollm2_bf16
    eng = SpecCacheEngine(model, tok, store="memory://")
    assert not eng.load_stats.gate_failed, eng.load_stats.gate_line()   # else every method serves full prefill
    eng.precompute(CHUNKS)
    assert eng.dtype == str(request.param).removeprefix("torch.")
    return eng


@pytest.fixture(scope="module")
def full_out(engine):
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    return engine.generate(prompt, max_new_tokens=12, reuse=ReuseConfig(method="full"), return_first_logits=True)


@pytest.mark.parametrize("method", ALL_BUT_REUSE)
def test_every_method_at_ratio_one_equals_full_prefill(engine, full_out, method):
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    out = engine.generate(prompt, max_new_tokens=12, reuse=ReuseConfig(method=method, recompute_ratio=1.0),
                          return_first_logits=True)
    assert out.stats.cache_hits == (0 if method == "full" else len(CHUNKS))
    assert out.stats.recomputed_tokens == out.stats.prompt_tokens
    assert_reproduces(out.first_logits, full_out.first_logits, engine.ops.dtype)
    assert out.token_ids == full_out.token_ids
    assert out.stats.dtype == engine.dtype


@pytest.mark.parametrize("method, options", [
    ("qattn", dict(qattn_rounds=2)), ("qattn", dict(qattn_rounds=3, qattn_sink=4, qattn_pool=3)),
    ("qattn", dict(propagate=0.5, propagate_window=0)), ("qattn", dict(propagate=1.0, propagate_window=3)),
    ("epic", dict(propagate=1.0)), ("cacheblend", dict(propagate=1.0))])
def test_method_options_at_ratio_one_equal_full_prefill(engine, full_out, method, options):
    """A budget that covers every chunk token is one round, and leaves no stale token to correct: exact at r = 1."""
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    out = engine.generate(prompt, max_new_tokens=12, reuse=ReuseConfig(method=method, recompute_ratio=1.0, **options),
                          return_first_logits=True)
    assert_reproduces(out.first_logits, full_out.first_logits, engine.ops.dtype)
    assert out.token_ids == full_out.token_ids


def test_propagate_changes_a_partial_blend(engine):
    """The option reaches the blend: at r = 0.3 stale tokens' values move, so the first token's logits do."""
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    plain, moved = (engine.generate(prompt, max_new_tokens=1, return_first_logits=True,
                                    reuse=ReuseConfig(recompute_ratio=0.3, propagate=share)) for share in (0.0, 0.5))
    nearest = engine.generate(prompt, max_new_tokens=1, return_first_logits=True,
                              reuse=ReuseConfig(recompute_ratio=0.3, propagate=0.5, propagate_window=0))
    assert plain.stats.reused_tokens > 0
    assert (plain.first_logits - moved.first_logits).abs().max() > 1e-3
    assert (nearest.first_logits - moved.first_logits).abs().max() > 1e-4      # the window reaches the blend too


def test_reuse_without_recompute_measurably_differs(engine, full_out):
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    out = engine.generate(prompt, max_new_tokens=12, reuse=ReuseConfig(method="reuse"), return_first_logits=True)
    assert out.stats.cache_hits == len(CHUNKS)
    assert 0 < out.stats.recomputed_tokens < out.stats.prompt_tokens / 2
    kl = F.kl_div(out.first_logits.log_softmax(-1), full_out.first_logits.log_softmax(-1), log_target=True,
                  reduction="sum")
    assert (out.first_logits - full_out.first_logits).abs().max() > 0.1
    assert kl > 1e-3
    assert logits_mismatch(out.first_logits, full_out.first_logits, engine.ops.dtype) is not None   # the gate sees it


def test_bfloat16_rounding_noise_still_reproduces_full_prefill(smollm2_bf16):
    """A bf16 run that is not bitwise full prefill's own (another kernel or thread split, as on CPUs with native
    bf16) must pass the gate's criterion: one-ulp noise on the embeddings moves logits by far more than an
    elementwise tolerance, but not the distribution."""
    model, tok = smollm2_bf16
    ops = HFLayers(model)
    ids = torch.tensor(render(RAGPrompt(chunks=CHUNKS, question=QUESTION), tok).ids)
    _, ref = full_prefill(ops, ids)
    embed, g = ops.embed, torch.Generator().manual_seed(0)

    def one_ulp_off(token_ids):
        e = embed(token_ids)
        sign = torch.randint(0, 2, e.shape, generator=g) * 2 - 1
        return e + e * (sign * (torch.rand(e.shape, generator=g) < 0.3)).to(e.dtype) * 2 ** -8
    ops.embed = one_ulp_off
    _, noisy = full_prefill(ops, ids)
    assert not torch.equal(noisy, ref)
    assert logits_mismatch(noisy, ref, torch.bfloat16) is None


class _FakeTok:
    """Enough of a tokenizer for tiny_random_model when no text is involved."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __len__(self):
        return 1000


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3", "mistral", "phi3", "gemma3"])
def test_every_method_at_ratio_one_equals_full_prefill_on_each_architecture(arch, dtype):
    """The guard on a tiny random-weight model of each architecture added after llama/qwen2."""
    model, tok = tiny_random_model(arch, dtype=dtype)
    engine = SpecCacheEngine(model, tok, store="memory://")
    assert engine.load_stats.gate_methods and not engine.load_stats.gate_failed     # the gate ran on it too
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    engine.precompute(CHUNKS)
    full = engine.generate(prompt, max_new_tokens=6, reuse=ReuseConfig(method="full"), return_first_logits=True)
    for method in ALL_BUT_REUSE[1:]:
        out = engine.generate(prompt, max_new_tokens=6, reuse=ReuseConfig(method=method, recompute_ratio=1.0),
                              return_first_logits=True)
        assert out.stats.reused_tokens == 0 and out.token_ids == full.token_ids, method
        assert_reproduces(out.first_logits, full.first_logits, dtype)
    reused = engine.generate(prompt, max_new_tokens=1, reuse=ReuseConfig(method="reuse"), return_first_logits=True)
    assert reused.stats.reused_tokens > 0
    assert (reused.first_logits - full.first_logits).abs().max() > 1e-3             # reuse alone is not exact


def test_a_window_every_layer_shares_bounds_the_context():
    from transformers import MistralConfig

    from speccache_rag.layers import attention_span

    assert attention_span(MistralConfig(sliding_window=4096, max_position_embeddings=32768)) == 4096
    assert attention_span(MistralConfig(sliding_window=None, max_position_embeddings=32768)) == 32768


def test_sliding_windows_on_some_layers_attend_within_the_window():
    """Qwen3 with ``use_sliding_window`` marks its upper layers sliding; the runner follows, in prefill, in a blend
    of scattered positions and in decode (the prompt is longer than the window)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, use_sliding_window=True, sliding_window=8,
                      max_window_layers=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ops = HFLayers(model)
    assert ops.windows == [None, 8, 8]
    ids = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids[None]).logits[0, -1]
        ref_next = model(torch.cat([ids, torch.tensor([7])])[None]).logits[0, -1]
    exact, last = full_prefill(ops, ids, capacity=31)
    torch.testing.assert_close(last, ref, atol=1e-5, rtol=1e-5)
    cache = KVCache(exact.k.clone(), exact.v.clone())
    subset = torch.cat([torch.arange(3, 9), torch.arange(20, 30)])
    cache.k[:, :, subset] = 0
    cache.v[:, :, subset] = 0
    torch.testing.assert_close(prefill(ops, cache, ids[subset], subset), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode_one(ops, cache, 7, 30), ref_next, atol=1e-5, rtol=1e-5)


def test_attention_logit_soft_capping_is_refused():
    from transformers import Qwen3Config

    from speccache_rag.layers import check_arch

    class Model:
        config = Qwen3Config(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    Model.config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="soft-capping"):
        check_arch(Model())
