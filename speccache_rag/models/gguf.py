"""The model cache and GGUF handling: verify, assemble split parts, de-quantize and convert to safetensors."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from . import registry
from .registry import ModelFileError, PackagedModel

GGUF_MAGIC = b"GGUF"
SOURCE_FILE = "speccache_source.json"  # written last into a converted directory
_CHUNK = 8 * 1024 * 1024


# --------------------------------------------------------------------------------------------------
# cache layout
# --------------------------------------------------------------------------------------------------
def cache_home() -> Path:
    """``$SPECCACHE_HOME`` or the platform's user cache directory for speccache-rag."""
    env = os.environ.get("SPECCACHE_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("speccache-rag"))


def _dirs() -> tuple[Path, Path, Path]:
    home = cache_home()
    models, gguf_dir, locks = home / "models", home / "gguf", home / "locks"
    for d in (models, gguf_dir, locks):
        d.mkdir(parents=True, exist_ok=True)
    return models, gguf_dir, locks


@contextlib.contextmanager
def _locked(lock_path: Path):
    """An inter-process lock (``filelock``); only the atomic renames protect us without it."""
    try:
        from filelock import FileLock, Timeout
    except ImportError:  # pragma: no cover - filelock ships with huggingface_hub
        yield
        return
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=1)
    except Timeout:
        print(f"[speccache-rag] waiting for another process preparing {lock_path.stem} …", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _is_converted(d: Path) -> bool:
    return (d / SOURCE_FILE).is_file() and (d / "config.json").is_file()


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _progress(total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)


def _sha256_file(path: Path, desc: str | None = None) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, _progress(size, desc or f"hashing {path.name}") as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# GGUF verification and assembly
# --------------------------------------------------------------------------------------------------
def _verify_gguf(path: Path, expected_size: int | None = None) -> dict[str, Any]:
    """Check magic, size and that ``gguf.GGUFReader`` can read the header and every tensor's extent.

    Returns a few header facts (architecture, tensor count). Raises ``ModelFileError``.
    """
    if not path.is_file():
        raise ModelFileError(f"GGUF file not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    if expected_size is not None and size != expected_size:
        raise ModelFileError(f"{path} has {size} bytes, expected {expected_size}: truncated or wrong parts")
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        n_tensors = len(reader.tensors)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        arch_field = reader.fields.get("general.architecture")
        arch = arch_field.contents() if arch_field is not None else None
        template_field = reader.fields.get("tokenizer.chat_template")
        template = template_field.contents() if template_field is not None else None
    except Exception as e:  # GGUFReader raises ValueError / IndexError / struct errors on damage
        raise ModelFileError(f"{path} is not a readable GGUF file (truncated or corrupt): {e}") from e
    if n_tensors == 0:
        raise ModelFileError(f"{path} holds no tensors")
    if end > size:
        raise ModelFileError(f"{path} is truncated: tensor data ends at byte {end}, file has {size}")
    return {"architecture": arch, "tensor_count": n_tensors, "size": size, "chat_template": template}


def _assemble(spec: PackagedModel, gguf_dir: Path) -> tuple[Path, str, dict[str, Any]]:
    """Return (path of the verified GGUF, its SHA-256, header facts), assembling split parts into the cache.

    Single-part models are used in place.  The SHA-256 is recorded in ``<name>.gguf.json`` the first
    time and checked against it (and against the registry's pin, when set) afterwards.
    """
    parts = registry._part_paths(spec)
    sidecar = gguf_dir / f"{spec.gguf_filename}.json"
    recorded = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
    total = sum(p.stat().st_size for p in parts)
    if spec.size is not None and total != spec.size:
        raise ModelFileError(
            f"the installed parts of {spec.name!r} hold {total} bytes, expected {spec.size}; "
            f"reinstall with: {spec.install_command()} --force-reinstall"
        )

    if len(parts) == 1:
        target = parts[0]
        info = _verify_gguf(target, spec.size)
        sha = recorded.get("sha256") if recorded.get("size") == total and recorded.get("path") == str(target) \
            and recorded.get("mtime_ns") == target.stat().st_mtime_ns else None
        if sha is None:
            sha = _sha256_file(target, f"hashing {spec.name}")
    else:
        target = gguf_dir / spec.gguf_filename
        if target.is_file() and target.stat().st_size == total and recorded.get("sha256") \
                and recorded.get("mtime_ns") == target.stat().st_mtime_ns:
            sha = recorded["sha256"]
            info = _verify_gguf(target, total)
        else:
            tmp = gguf_dir / f".{spec.gguf_filename}.{uuid.uuid4().hex}.part"
            h = hashlib.sha256()
            try:
                with open(tmp, "wb") as out, _progress(total, f"assembling {spec.name}") as bar:
                    for p in parts:
                        with open(p, "rb") as f:
                            while chunk := f.read(_CHUNK):
                                out.write(chunk)
                                h.update(chunk)
                                bar.update(len(chunk))
                info = _verify_gguf(tmp, total)
                os.replace(tmp, target)
            finally:
                if tmp.exists():
                    tmp.unlink()
            sha = h.hexdigest()

    checks = [(spec.sha256, "the registry's pin", "")]
    checks.append((recorded.get("sha256"), f"the SHA-256 recorded in {sidecar}",
                   f" (or delete {sidecar} if the packages were changed on purpose)"))
    for expected, what, hint in checks:
        if expected and expected != sha:
            if len(parts) > 1:
                with contextlib.suppress(OSError):
                    target.unlink()
            raise ModelFileError(
                f"{spec.name!r}: the GGUF has SHA-256 {sha}, which does not match {what} ({expected}); "
                f"reinstall with: {spec.install_command()} --force-reinstall{hint}"
            )
    if not recorded:
        _write_json_atomic(sidecar, {
            "name": spec.name, "sha256": sha, "size": total, "path": str(target),
            "mtime_ns": target.stat().st_mtime_ns,
            "parts": [str(p) for p in parts],
            "packages": {d: spec.version for d in spec.packages},
        })
    elif recorded.get("mtime_ns") != target.stat().st_mtime_ns or recorded.get("path") != str(target):
        _write_json_atomic(sidecar, {**recorded, "path": str(target), "mtime_ns": target.stat().st_mtime_ns})
    return target, sha, info


# --------------------------------------------------------------------------------------------------
# GGUF -> safetensors conversion
# --------------------------------------------------------------------------------------------------
def _convert(gguf_path: Path, final: Path, source: dict[str, Any], chat_template: str | None = None) -> None:
    """De-quantize ``gguf_path`` to float32 and save a transformers directory at ``final``.

    Everything is written into a sibling temp directory that is renamed into place at the end, so an
    interrupted conversion leaves nothing that looks usable and is simply redone.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    log = lambda msg: print(f"[speccache-rag] {final.name}: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        log(f"converting {gguf_path.name} to safetensors (once; cached in {final}) …")
        kwargs: dict[str, Any] = {"gguf_file": gguf_path.name, "dtype": torch.float32}
        try:  # force full de-quantization even where packed GGUF kernels exist
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:  # pragma: no cover - older transformers always de-quantize
            pass
        gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), **kwargs)
        t_load = time.perf_counter()
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = source.get("name", final.name)
        log(f"de-quantized in {t_load - t0:.1f}s; saving safetensors …")
        state = gguf_model.state_dict()
        with _no_init():  # every parameter is overwritten just below; random init costs seconds
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # take over the de-quantized tensors instead of copying them: halves peak memory
        model.load_state_dict(state, strict=True, assign=True)
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
        del state, gguf_model
        if model.generation_config is not None:
            model.generation_config.bos_token_id = config.bos_token_id
            model.generation_config.eos_token_id = config.eos_token_id
            model.generation_config.pad_token_id = config.pad_token_id
        model.save_pretrained(str(tmp))
        del model
        t_save = time.perf_counter()
        log(f"saved weights in {t_save - t_load:.1f}s; converting the tokenizer …")

        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        if chat_template and not tokenizer.chat_template:
            tokenizer.chat_template = chat_template
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.save_pretrained(str(tmp))
        _check_tokenizer_roundtrip(tokenizer, tmp)

        t_end = time.perf_counter()
        import transformers

        _write_json_atomic(tmp / SOURCE_FILE, {
            **source,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "dtype": "float32",
            "convert_seconds": round(t_end - t0, 2),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        })
        if final.exists():  # an old, incomplete directory (never a complete one: callers check first)
            shutil.rmtree(final)
        os.rename(tmp, final)
        log(f"done in {t_end - t0:.1f}s")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def _check_tokenizer_roundtrip(tokenizer, saved: Path) -> None:
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(str(saved))
    probe = "Hello world! The capital of France is Paris. 123 \n\t ünïcödé"
    if again.encode(probe) != tokenizer.encode(probe):
        raise RuntimeError("saved tokenizer encodes differently from the GGUF tokenizer")
    if (again.chat_template or None) != (tokenizer.chat_template or None):
        raise RuntimeError("chat template was lost when saving the tokenizer")


def _clean_stale(models_dir: Path, name: str) -> None:
    """Remove temp directories of interrupted conversions of ``name`` (call with its lock held)."""
    for p in models_dir.glob(f".tmp-{name}-*"):
        shutil.rmtree(p, ignore_errors=True)


def _ensure_converted(key: str, get_gguf, source: dict[str, Any]) -> Path:
    models_dir, _, locks = _dirs()
    final = models_dir / key
    if _is_converted(final):
        return final
    with _locked(locks / f"{key}.lock"):
        if _is_converted(final):  # another process finished meanwhile
            return final
        _clean_stale(models_dir, key)
        if final.exists():  # incomplete (no completion record): left by an interrupted run
            shutil.rmtree(final)
        gguf_path, sha, info = get_gguf()
        _convert(gguf_path, final, {**source, "gguf": str(gguf_path), "gguf_sha256": sha,
                                    "gguf_architecture": info.get("architecture")},
                 chat_template=info.get("chat_template"))
    return final


def _gguf_key(path: Path) -> tuple[str, str, dict[str, Any] | None]:
    """Cache key ``<stem>-<sha256[:16]>`` for a GGUF file; the hash is memoized by (path, size, mtime)."""
    _, gguf_dir, _ = _dirs()
    index_path = gguf_dir / "hashes.json"
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    sha, info = index.get(ident), None
    if sha is None:
        info = _verify_gguf(path)
        sha = _sha256_file(path)
        index[ident] = sha
        with contextlib.suppress(OSError):
            _write_json_atomic(index_path, index)
    stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in path.stem)[:64]
    return f"{stem}-{sha[:16]}", sha, info
