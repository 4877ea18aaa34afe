"""Hugging Face Hub ids (``"Qwen/Qwen2.5-0.5B-Instruct"``, ``"org/name@revision"``) → a local snapshot directory.

Resolved through ``huggingface_hub`` and its cache, so a model downloaded by any Hugging Face tool is found
where it already is. The environment is read at each call, not at import (``HF_HOME``, ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE``, ``HF_TOKEN``): a process that sets them late is still honoured. Only what a causal LM
needs is fetched: the config, the tokenizer files and the safetensors weights.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
# transformers' own weight files only: some repos also ship a consolidated copy for other runtimes
WANTED = ["*.json", "model*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]


def is_hub_id(name: str) -> bool:
    """``org/name`` or ``org/name@revision`` that is not a local path."""
    return (bool(HUB_ID.match(name)) and not name.lower().endswith(".gguf")
            and not Path(name).expanduser().exists())


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def snapshot(hub_id: str) -> Path:
    """The local snapshot directory of ``org/name[@revision]``: from the cache, else downloaded (not offline)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise ImportError("Hub ids need huggingface_hub: pip install huggingface_hub") from e
    repo_id, _, revision = hub_id.partition("@")
    cache = hub_cache()
    where = f"{repo_id}" + (f" at revision {revision}" if revision else "")
    try:
        path = snapshot_download(repo_id, revision=revision or None, cache_dir=cache, allow_patterns=WANTED,
                                 local_files_only=offline(), token=os.environ.get("HF_TOKEN"))
    except LocalEntryNotFoundError as e:
        how = ("HF_HUB_OFFLINE is set, so nothing is downloaded" if offline()
               else "the Hub could not be reached")
        raise FileNotFoundError(f"{where} is not a local path, nor in the Hugging Face cache at {cache}, and {how}; "
                                f"download it first (`huggingface-cli download {repo_id}`) or point HF_HOME at the "
                                "cache that holds it") from e
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise FileNotFoundError(f"{repo_id} is not a model the Hub serves to this token ({type(e).__name__}); "
                                "check the id, and HF_TOKEN for a gated or private model") from e
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"{repo_id} has no revision {revision!r}") from e
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{where} (snapshot {path}) has no config.json: not a transformers model")
    return path
