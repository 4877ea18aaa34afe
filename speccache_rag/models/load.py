"""Resolution and loading: a packaged name, HF directory, Hub id or .gguf file → local directory → model + tokenizer."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from ..hardware import resolve_dtype
from . import gguf
from .hub import is_hub_id, snapshot
from .gguf import GGUF_MAGIC, _dirs, _ensure_converted, _gguf_key, _is_converted, _verify_gguf
from .registry import PACKAGED, SUPPORTED_MODEL_TYPES, PackagedModel


def _resolve_packaged(spec: PackagedModel) -> Path:
    models_dir, gguf_dir, _ = _dirs()
    final = models_dir / spec.name
    if _is_converted(final):
        return final

    def get_gguf():
        return gguf._assemble(spec, gguf_dir)

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


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A local transformers directory (safetensors + tokenizer + config) for a model.

    ``name_or_path`` is a packaged name (see ``PACKAGED``), a Hugging Face model directory (holding
    ``config.json``; returned as is), a Hub id ``org/name[@revision]`` (its snapshot in the Hugging Face
    cache, downloaded there unless ``HF_HUB_OFFLINE``; ``hub.py``) or a ``.gguf`` file.  Packaged and GGUF
    models are converted once into ``cache_home()/models``.
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
    if is_hub_id(s):
        return snapshot(s)
    if path.suffix.lower() == ".gguf" or os.sep in s or "/" in s:
        raise FileNotFoundError(f"no such model file or directory: {s} (nor a Hugging Face id, org/name[@revision])")
    raise ValueError(
        f"unknown model {s!r}: not a packaged model name ({', '.join(PACKAGED)}), "
        f"a Hugging Face id (org/name[@revision]), a model directory or a .gguf file"
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
