"""dtype="auto" and the thread default: the capability check is faked, the computation never is."""
import pytest
import torch

from speccache_rag import hardware
from speccache_rag.kv import model_fingerprint


@pytest.fixture
def cpu_with(monkeypatch):
    def fake(*flags):
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"sse2", "avx2", *flags}))
    return fake


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_is_bfloat16_where_the_cpu_computes_it(cpu_with, flag):
    cpu_with(flag)
    assert hardware.native_bf16("cpu")
    assert hardware.resolve_dtype("auto") is torch.bfloat16
    assert hardware.dtype_name("auto") == "bfloat16"


def test_auto_is_float32_where_bfloat16_would_be_emulated(cpu_with):
    cpu_with("avx512f", "avx512bw")                     # AVX-512 without its BF16 extension
    assert not hardware.native_bf16("cpu")
    assert hardware.resolve_dtype("auto") is torch.float32


def test_cuda_without_a_device_is_not_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not hardware.native_bf16("cuda")


def test_explicit_dtypes_pass_through_and_unknown_ones_are_refused(cpu_with):
    cpu_with("avx512_bf16")
    assert hardware.resolve_dtype("float32") is torch.float32
    assert hardware.resolve_dtype(torch.float32) is torch.float32
    assert hardware.resolve_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        hardware.resolve_dtype("int8")


def test_cpu_flags_are_read_from_this_machine():
    flags = hardware.cpu_flags()
    assert isinstance(flags, frozenset)
    if flags:                                            # Linux: every x86-64 CPU reports sse2
        assert "sse2" in flags or "fp" in flags or "asimd" in flags


def test_threads_default_to_the_usable_cores(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv(hardware.THREADS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    try:
        assert hardware.configure_threads() == 3 == torch.get_num_threads()
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert hardware.configure_threads() == 2 == torch.get_num_threads()
        monkeypatch.setenv(hardware.THREADS_ENV, "1")
        assert hardware.configure_threads() == 1 == torch.get_num_threads()
        assert hardware.configure_threads(2) == 2 == torch.get_num_threads()
        monkeypatch.setenv(hardware.THREADS_ENV, "many")
        with pytest.raises(ValueError, match="SPECCACHE_THREADS must be a positive integer"):
            hardware.configure_threads()
        with pytest.raises(ValueError, match="threads must be >= 1"):
            hardware.configure_threads(0)
    finally:
        torch.set_num_threads(before)


def test_fingerprint_keeps_dtypes_apart(smollm2, smollm2_bf16):
    fp32 = model_fingerprint(smollm2[0], smollm2[1], "bos")
    bf16 = model_fingerprint(smollm2_bf16[0], smollm2_bf16[1], "bos")
    assert fp32 != bf16


def test_bf16_chunk_kv_is_stored_in_bf16_at_half_the_bytes(smollm2, smollm2_bf16):
    from speccache_rag import SpecCacheEngine
    from speccache_rag.kv import chunk_key
    from speccache_rag.prompt import tokenize_piece

    text = "Mira Quell founded Zorblat Industries in Vessendorf in 1987."
    sizes = {}
    for model, tok in (smollm2, smollm2_bf16):
        eng = SpecCacheEngine(model, tok, store="memory://")
        key = eng.precompute([text])[0]
        entry = eng.store.get(key)
        assert key == chunk_key(eng.fingerprint, tokenize_piece(tok, text)[0])
        assert entry.k.dtype == entry.v.dtype == next(model.parameters()).dtype
        sizes[eng.dtype] = entry.k.nbytes + entry.v.nbytes
    assert sizes["bfloat16"] * 2 == sizes["float32"]
