"""What the connector shares with the torch engine: model fingerprint, sink tokens, stores, and
finding stored chunks inside an arbitrary prompt by token content.

The fingerprint has one definition, :func:`speccache_rag.kv.model_fingerprint`, over the Hugging
Face model. vLLM holds the same weights under other names (fused QKV), so the fingerprint of a vLLM
model is that of the HF model loaded from the same converted directory at the same dtype, computed
once and cached in a JSON file keyed by the directory's files (size, mtime) — later engine starts
read the JSON. KV precomputed by the torch backend and by the vLLM backend thus share keys.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from collections import defaultdict
from pathlib import Path

from ..kv import KV_LAYOUT_VERSION, chunk_key, model_fingerprint
from ..store import DiskStore, KVStore, open_store

_FP_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def _dir_signature(model_dir: Path) -> list:
    sig = []
    for p in sorted(model_dir.iterdir()):
        if p.suffix == ".safetensors" or p.name in _FP_FILES:
            st = p.stat()
            sig.append([p.name, st.st_size, st.st_mtime_ns])
    return sig


@functools.lru_cache(maxsize=16)
def fingerprint_for(model_dir: str, dtype: str, sink: str) -> str:
    """``model_fingerprint`` of the HF model in ``model_dir`` at ``dtype`` (e.g. "float32"), cached on disk."""
    from ..models import cache_home, load, resolve

    path = resolve(model_dir).resolve()      # vLLM may serve a Hub id: its snapshot in the Hugging Face cache
    ident = json.dumps({"dir": str(path), "files": _dir_signature(path), "dtype": dtype, "sink": sink,
                        "layout": KV_LAYOUT_VERSION}, sort_keys=True)
    cache = cache_home() / "fingerprints" / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.json"
    try:
        return json.loads(cache.read_text())["fingerprint"]
    except (OSError, ValueError, KeyError):
        pass
    model, tok = load(path, dtype=dtype)
    fp = model_fingerprint(model, tok, sink)
    del model
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"fingerprint": fp, "ident": json.loads(ident)}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return fp


# ---- stores shared inside one process ------------------------------------------------------------
_SHARED: dict[str, KVStore] = {}
_SHARED_LOCK = threading.Lock()
OBJECT_SCHEME = "speccache-object://"


def shared_store(spec: str | KVStore) -> tuple[KVStore, str]:
    """(store, url): the scheduler and worker connectors and an in-process engine live in one process
    and must see one ``memory://`` store; a ``KVStore`` object is registered under an object URL."""
    with _SHARED_LOCK:
        if isinstance(spec, KVStore):
            url = f"{OBJECT_SCHEME}{id(spec)}"
            _SHARED[url] = spec
            return spec, url
        spec = os.fspath(spec)
        if spec.startswith(OBJECT_SCHEME):
            if spec not in _SHARED:
                raise ValueError(f"store {spec} is an in-process object of another process; "
                                 "use a directory or redis:// store with vllm serve")
            return _SHARED[spec], spec
        if spec.startswith("memory://"):
            if spec not in _SHARED:
                _SHARED[spec] = open_store(spec)
            return _SHARED[spec], spec
        return open_store(spec), spec


# ---- finding stored chunks by token content ------------------------------------------------------
def peek_token_ids(store: KVStore, key: str) -> list[int] | None:
    """A stored entry's token ids, reading only the safetensors header where the store is a directory."""
    if isinstance(store, DiskStore):
        ids = (store.entry_meta(key) or {}).get("token_ids")
        return list(ids) if isinstance(ids, list) else None
    entry = store.get(key)
    return None if entry is None else list(entry.token_ids)


def holds(store: KVStore, fingerprint: str, key: str) -> bool:
    """Whether ``store`` holds ``key`` as an entry of ``fingerprint`` (a model, or a tenant of it)."""
    ids = peek_token_ids(store, key) if store.contains(key) else None
    return ids is not None and chunk_key(fingerprint, ids) == key


class StoredChunkIndex:
    """Stored chunks of one model, indexed by their first ``head`` tokens, for finding them in prompts.

    Entries are content-addressed (key = f(fingerprint, token ids)) and so never change; the index
    only learns new keys and forgets deleted ones. Entries of other models are remembered as foreign
    and never read twice.
    """

    def __init__(self, store: KVStore, fingerprint: str, head: int = 8):
        self.store, self.fingerprint, self.head = store, fingerprint, max(1, head)
        self._ids: dict[str, list[int]] = {}
        self._foreign: set[str] = set()
        self._by_head: dict[tuple, list[str]] = defaultdict(list)
        self._lock = threading.Lock()

    def refresh(self) -> None:
        keys = set(self.store.keys())
        with self._lock:
            for key in list(self._ids):
                if key not in keys:
                    ids = self._ids.pop(key)
                    self._by_head[tuple(ids[: self.head])].remove(key)
            for key in keys - self._ids.keys() - self._foreign:
                ids = peek_token_ids(self.store, key)
                if ids is None:
                    continue
                if len(ids) < self.head or chunk_key(self.fingerprint, ids) != key:
                    self._foreign.add(key)
                    continue
                self._ids[key] = ids
                self._by_head[tuple(ids[: self.head])].append(key)

    def __len__(self) -> int:
        return len(self._ids)

    def find(self, prompt: list[int]) -> list[tuple[int, int, str]]:
        """Non-overlapping (start, end, key) of stored chunks in ``prompt``, left to right, longest first.

        A match may cover only a *prefix* of a stored chunk (at least ``head`` tokens): inside a
        prompt a chunk's last token often merges with what follows (a trailing newline before a
        blank line), and by causality the KV of a chunk's first tokens, computed alone, is the same
        whatever came after them — the worker reuses those entries and recomputes the rest.
        """
        found, i, n = [], 0, len(prompt)
        with self._lock:
            while i + self.head <= n:
                best, best_len = None, 0
                for key in self._by_head.get(tuple(prompt[i: i + self.head]), ()):
                    length = _common_prefix(prompt, i, self._ids[key])
                    if length > best_len:
                        best, best_len = key, length
                if best is None:
                    i += 1
                    continue
                found.append((i, i + best_len, best))
                i += best_len
        return found

    def place(self, prompt: list[int], keys: list[str]) -> tuple[list[tuple[int, int, str]], list[tuple[str, str]]]:
        """Where the chunks a client named by key are in ``prompt``: ``(placed, ignored)``.

        ``placed``: (start, end, key), sorted; a chunk is placed where the longest prefix of its tokens
        (at least ``head``) occurs, as in ``find``. ``ignored``: (key, reason) for every key that is not
        stored, belongs to another model, or whose tokens the prompt does not contain — a name alone
        never makes a reuse.
        """
        placed: list[tuple[int, int, str]] = []
        ignored: list[tuple[str, str]] = []
        with self._lock:
            for key in dict.fromkeys(keys):
                ids = self._ids.get(key)
                if ids is None:
                    reason = ("stored by another model, tokenizer, dtype or sink policy" if key in self._foreign
                              else "not in the store (never precomputed here, evicted, or unreadable)")
                    ignored.append((key, reason))
                    continue
                best, best_len = None, 0
                for i in range(len(prompt) - self.head + 1):
                    if prompt[i: i + self.head] != ids[: self.head]:
                        continue
                    length = _common_prefix(prompt, i, ids)
                    if length > best_len and not any(s < i + length and i < e for s, e, _ in placed):
                        best, best_len = i, length
                if best is None:
                    ignored.append((key, "its tokens are not in this prompt"))
                else:
                    placed.append((best, best + best_len, key))
        return sorted(placed), ignored


def _common_prefix(prompt: list[int], start: int, ids: list[int]) -> int:
    n = min(len(ids), len(prompt) - start)
    j = 0
    while j < n and prompt[start + j] == ids[j]:
        j += 1
    return j

