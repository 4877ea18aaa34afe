"""SpeCache offloaded decoding: the checks of docs/offload.md (quantizer, tiers, the decode loop)."""
import copy

import pytest
import torch

from speccache_rag import RAGPrompt, SpecCacheEngine
from speccache_rag.config import OffloadConfig
from speccache_rag.layers import HFLayers
from speccache_rag.offload import OffloadDecoder
from speccache_rag.offload.kivi import dequantize, pack, quantize, unpack
from speccache_rag.offload.tiers import LayerTiers, resident_bytes_formula
from speccache_rag.runner import KVCache, decode_one, full_prefill

from tiny_models import tiny_random_model

G = torch.Generator().manual_seed(0)


# ---- quantizer --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack_is_bit_exact(bits):
    codes = torch.randint(0, 2 ** bits, (3, 5, 64), generator=G, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_error_within_half_a_step(bits):
    x = torch.randn(16, 64, generator=G) * 3
    codes, scale, zero = quantize(x, bits, dim=-1)
    assert int(codes.max()) <= 2 ** bits - 1
    err = (dequantize(codes, scale, zero, x.dtype) - x).abs()
    assert (err <= scale / 2 + 1e-5).all()


def test_one_bit_uses_quarter_points_and_clamps_the_maximum():
    x = torch.tensor([[0.0, 1.0, 4.0, 3.0, 0.5, 4.0]])      # at the max, (x − zero)/scale = 1.5 exactly
    codes, scale, zero = quantize(x, 1, dim=-1)
    assert codes.max() == 1                                 # rounding 1.5 up to 2 would be a 2-bit code
    assert float(zero) == 1.0 and float(scale) == 2.0       # (3·min + max)/4 and (max − min)/2
    xhat = dequantize(codes, scale, zero, x.dtype)
    assert set(xhat.flatten().tolist()) <= {1.0, 3.0}
    assert ((xhat - x).abs() <= (x.max() - x.min()) / 4 + 1e-6).all()
    y = torch.randn(32, 64, generator=G)
    c, s, z = quantize(y, 1, dim=-1)
    spread = y.amax(-1, keepdim=True) - y.amin(-1, keepdim=True)
    assert ((dequantize(c, s, z, y.dtype) - y).abs() <= spread / 4 + 1e-5).all()


@pytest.mark.parametrize("bits", [1, 2])
def test_constant_groups_are_exact(bits):
    x = torch.full((4, 64), 0.3)
    x[1] = 0.0
    codes, scale, zero = quantize(x, bits, dim=-1)
    xhat = dequantize(codes, scale, zero, x.dtype)
    assert not xhat.isnan().any() and torch.equal(xhat, x)


# ---- tiers ------------------------------------------------------------------------------------------
def _kv(n, kvh=2, d=16, dtype=torch.float32):
    return torch.randn(kvh, n, d, generator=G).to(dtype), torch.randn(kvh, n, d, generator=G).to(dtype)


@pytest.mark.parametrize("bits", [1, 2])
def test_streaming_appends_equal_one_shot_quantization(bits):
    cfg = OffloadConfig(bits=bits, topk=4, group=8, residual=16)
    k, v = _kv(75)
    streamed = LayerTiers(k[:, :21], v[:, :21], cfg, capacity=80)
    for i in range(21, 75):
        streamed.append(k[:, i], v[:, i])
    one_shot = LayerTiers(k, v, cfg, capacity=80)
    assert (streamed.nk, streamed.nv) == (one_shot.nk, one_shot.nv) == (64, 59)
    for a, b in zip(streamed.dequantized(), one_shot.dequantized()):
        assert torch.equal(a, b)
    assert streamed.resident_bytes() == one_shot.resident_bytes()


def test_fetched_rows_are_host_rows_and_the_rest_stay_dequantized():
    cfg = OffloadConfig(bits=2, topk=4, group=8, residual=16)
    k, v = _kv(50)
    tiers = LayerTiers(k, v, cfg, capacity=50)
    idx = torch.tensor([[0, 7, 20, 31], [3, 4, 5, 47]])
    tiers.fetch(idx)
    dk, dv = tiers.dequantized()
    mk, mv = tiers.mixed()
    fetched = torch.zeros(2, 50, dtype=torch.bool).scatter_(1, idx, True)
    assert torch.equal(mk[fetched], k[fetched]) and torch.equal(mv[fetched], v[fetched])
    assert torch.equal(mk[~fetched], dk[~fetched]) and torch.equal(mv[~fetched], dv[~fetched])
    assert tiers.fetched_bytes == 2 * idx.numel() * 16 * 4


def test_large_positions_fetch_without_overflow():
    cfg = OffloadConfig(bits=2, topk=2, group=8, residual=8)
    k, v = _kv(70_000, kvh=1, d=8)
    tiers = LayerTiers(k, v, cfg, capacity=70_001)
    idx = torch.tensor([[65_537, 69_990]])
    tiers.fetch(idx)
    mk, _ = tiers.mixed()
    assert torch.equal(mk[0, 69_990], k[0, 69_990]) and torch.equal(mk[0, 65_537], k[0, 65_537])


@pytest.mark.parametrize("bits,dtype", [(1, torch.float32), (2, torch.bfloat16), (4, torch.float32)])
def test_resident_bytes_measured_equal_the_formula(bits, dtype):
    cfg = OffloadConfig(bits=bits, topk=8, group=16, residual=32)
    k, v = _kv(100, d=32, dtype=dtype)
    tiers = LayerTiers(k, v, cfg, capacity=140)
    assert tiers.resident_bytes() == resident_bytes_formula(100, 2, 32, cfg, k.element_size(), 140)
    for _ in range(31):
        tiers.append(k[:, 0], v[:, 0])
    assert tiers.resident_bytes() == resident_bytes_formula(131, 2, 32, cfg, k.element_size(), 140)


def test_offload_config_is_validated():
    for bad in (dict(bits=3), dict(topk=-1), dict(group=16, residual=24), dict(prefetch="later")):
        with pytest.raises(ValueError):
            OffloadConfig(**bad)
    assert OffloadConfig.parse("1bit") == OffloadConfig(bits=1) and OffloadConfig.parse("off") is None
    with pytest.raises(ValueError, match="2bit"):
        OffloadConfig.parse("two bits")


# ---- the decode loop --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    model, _ = tiny_random_model("qwen2", seed=3, num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2)
    return HFLayers(model)


def _prefilled(ops, n=90, extra=20, seed=1):
    ids = torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed))
    cache, logits = full_prefill(ops, ids, capacity=n + extra)
    return cache, logits


def _decode(ops, cfg, steps=12, forced=None, n=90):
    """Greedy (or teacher-forced) offloaded decode → (tokens, per-step logits, decoder)."""
    cache, logits = _prefilled(ops, n)
    dec = OffloadDecoder(ops, cache, n, cfg, capacity=n + steps + 2)
    tok, toks, all_logits = int(logits.argmax()), [], []
    for t in range(steps):
        toks.append(tok)
        out = dec.step(tok, n + t)
        all_logits.append(out)
        tok = forced[t + 1] if forced is not None else int(out.argmax())
    dec.close()
    return toks, torch.stack(all_logits), dec


def _full_decode(ops, steps=12, forced=None, n=90):
    cache, logits = _prefilled(ops, n)
    tok, toks, all_logits = int(logits.argmax()), [], []
    for t in range(steps):
        toks.append(tok)
        out = decode_one(ops, cache, tok, n + t)
        all_logits.append(out)
        tok = forced[t + 1] if forced is not None else int(out.argmax())
    return toks, torch.stack(all_logits)


@pytest.mark.parametrize("cfg", [
    OffloadConfig(bits=2, topk=512, group=8, residual=16),                       # k ≥ context
    OffloadConfig(bits=1, topk=512, group=8, residual=16, speculative=False),
    OffloadConfig(bits=1, topk=0, group=8, residual=128),                        # R ≥ context
])
def test_exact_cases_equal_full_kv_decode(tiny, cfg):
    full_tokens, full_logits = _full_decode(tiny)
    tokens, logits, _ = _decode(tiny, cfg)
    assert tokens == full_tokens
    torch.testing.assert_close(logits, full_logits, atol=5e-4, rtol=1e-4)


def test_low_bit_decode_differs_from_full(tiny):
    _, full_logits = _full_decode(tiny)
    _, logits, _ = _decode(tiny, OffloadConfig(bits=1, topk=0, group=8, residual=16))
    assert (logits - full_logits).abs().max() > 1e-2


def test_output_logits_do_not_depend_on_the_speculative_token(tiny):
    cfg = OffloadConfig(bits=2, topk=8, group=8, residual=16)
    cache, logits = _prefilled(tiny)
    dec = OffloadDecoder(tiny, cache, 90, cfg, capacity=110)
    tok = int(logits.argmax())
    for t in range(3):
        tok = int(dec.step(tok, 90 + t).argmax())
    other = copy.deepcopy(dec)
    other.spec = (dec.spec + 17) % 1000
    a, b = dec.step(tok, 93), other.step(tok, 93)
    assert torch.equal(a, b)


def test_topk_zero_is_pure_low_bit_attention(tiny):
    """k = 0: the first decode step equals decode_one over a cache dequantized independently here."""
    n, g, r = 90, 8, 16
    cfg = OffloadConfig(bits=2, topk=0, group=g, residual=r, speculative=False)
    cache, logits = _prefilled(tiny, n)
    tok = int(logits.argmax())
    ref = KVCache(cache.k.clone(), cache.v.clone())
    nk, nv = n // r * r, n - r
    for i in range(tiny.num_layers):
        kb = cache.k[i, :, :nk].reshape(2, nk // g, g, -1)                     # keys: per channel per block
        ref.k[i, :, :nk] = dequantize(*quantize(kb, 2, dim=2), torch.float32).reshape(2, nk, -1)
        vb = cache.v[i, :, :nv].reshape(2, nv, 2, g)                          # values: per token, g channels
        ref.v[i, :, :nv] = dequantize(*quantize(vb, 2, dim=3), torch.float32).reshape(2, nv, -1)
    expected = decode_one(tiny, ref, tok, n)
    got = OffloadDecoder(tiny, cache, n, cfg, capacity=n + 4).step(tok, n)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    spec = _decode(tiny, OffloadConfig(bits=2, topk=0, group=g, residual=r))
    plain = _decode(tiny, cfg)
    assert spec[0] == plain[0]
    torch.testing.assert_close(spec[1], plain[1], atol=1e-5, rtol=1e-5)


def test_sync_and_async_prefetch_give_identical_outputs(tiny):
    sync = _decode(tiny, OffloadConfig(bits=1, topk=8, group=8, residual=16))
    async_ = _decode(tiny, OffloadConfig(bits=1, topk=8, group=8, residual=16, prefetch="async"))
    assert sync[0] == async_[0] and torch.equal(sync[1], async_[1])


def test_stats_count_fetches_and_hits(tiny):
    cfg = OffloadConfig(bits=2, topk=8, group=8, residual=16, oracle=True)
    _, _, dec = _decode(tiny, cfg, steps=6)
    s = dec.stats()
    # the pre-decode pass fetches once more than the 6 steps
    assert s.steps == 6 and s.fetched_bytes_per_step == pytest.approx(7 / 6 * 3 * 2 * 8 * 16 * 2 * 4)
    assert 0.0 <= s.prefetch_hit_rate <= 1.0 and 0.0 <= s.oracle_hit_rate <= 1.0
    assert 0.0 <= s.spec_token_hit_rate <= 1.0 and s.decode_tokens_per_s > 0
    assert s.full_kv_bytes == 3 * 2 * 2 * 96 * 16 * 4
    assert s.resident_bytes == 3 * resident_bytes_formula(96, 2, 16, cfg, 4, 104)


# ---- real model: recall and the engine --------------------------------------------------------------
@pytest.fixture(scope="module")
def real_prompt(smollm2):
    chunks = [f"Record {i}: the archive of town {i} lists {i * 7 % 23} bridges, {i * 5 % 17} mills and a "
              f"harbour master called {['Ada', 'Bo', 'Cy', 'Di', 'Ed', 'Flo'][i % 6]}." for i in range(24)]
    return RAGPrompt(chunks=chunks, question="Who is the harbour master of town 13?")


def test_oracle_recall_rises_with_k_on_a_real_model(smollm2, real_prompt):
    engine = SpecCacheEngine(*smollm2, store="memory://")
    reuse = __import__("speccache_rag").ReuseConfig(method="full")
    recall = []
    for k in (16, 128, 4096):
        cfg = OffloadConfig(bits=2, topk=k, group=32, residual=32, oracle=True, speculative=False)
        out = engine.generate(real_prompt, max_new_tokens=6, reuse=reuse, offload=cfg)
        recall.append(out.stats.offload.oracle_hit_rate)
    assert recall[0] < recall[1] < recall[2] == 1.0


def test_engine_offloads_after_a_blended_prefill(smollm2, real_prompt):
    from speccache_rag import ReuseConfig

    engine = SpecCacheEngine(*smollm2, store="memory://")
    engine.precompute(real_prompt.chunks)
    reuse = ReuseConfig(method="qattn", recompute_ratio=0.15)
    plain = engine.generate(real_prompt, max_new_tokens=8, reuse=reuse)
    exact = engine.generate(real_prompt, max_new_tokens=8, reuse=reuse,
                            offload=OffloadConfig(bits=2, topk=4096, group=32, residual=32))
    assert exact.token_ids == plain.token_ids and exact.stats.reused_tokens > 0
    stream = engine.stream(real_prompt, max_new_tokens=8, reuse=reuse, offload="1bit")
    text = "".join(stream)
    off = stream.output.stats.offload
    assert text == stream.output.text and off.bits == 1 and off.resident_ratio < 0.3
    assert off.full_kv_bytes == 2 * 30 * 3 * 64 * 4 * (plain.stats.prompt_tokens + off.steps)
    assert "offload=1bit" in stream.output.stats.line()
