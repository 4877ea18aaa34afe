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
import time
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
def peek_entry(store: KVStore, key: str) -> tuple[list[int], str | None, str | None] | None:
    """A stored entry's token ids and the fingerprint and model its metadata names, reading only the safetensors
    header where the store is a directory; None when it is gone or unreadable."""
    if isinstance(store, DiskStore):
        meta = store.entry_meta(key) or {}
        ids = meta.get("token_ids")
        return (list(ids), meta.get("fingerprint"), meta.get("model")) if isinstance(ids, list) else None
    entry = store.get(key)
    return None if entry is None else (list(entry.token_ids), entry.meta.get("fingerprint"), entry.meta.get("model"))


def peek_token_ids(store: KVStore, key: str) -> list[int] | None:
    found = peek_entry(store, key)
    return None if found is None else found[0]


def holds(store: KVStore, fingerprint: str, key: str) -> bool:
    """Whether ``store`` holds ``key`` as an entry of ``fingerprint`` (a model, or a tenant of it)."""
    ids = peek_token_ids(store, key) if store.contains(key) else None
    return ids is not None and chunk_key(fingerprint, ids) == key


class StoredChunkIndex:
    """Stored chunks of one model, of every tenant, indexed by (tenant fingerprint, first ``head`` tokens), for
    finding them in prompts.

    Entries are content-addressed (key = f(fingerprint, token ids)) and so never change. The index learns the
    keys put since it last looked from the store's journal (``KVStore.added_since``), so where the store keeps
    one (memory, directory, Redis) a query costs what is new, not the size of the store; each key is read once
    and checked against the fingerprint its metadata names (the key must be that fingerprint's hash of its
    tokens, and the fingerprint this model's or one of its tenants'). Entries of other models are remembered as foreign and never read twice. Deleted entries are
    forgotten at the next full listing (every ``resync_s``); until then a deleted entry is a store miss at blend
    time, recomputed like any other.
    """

    def __init__(self, store: KVStore, fingerprint: str, head: int = 8, resync_s: float = 300.0):
        self.store, self.fingerprint, self.head, self.resync_s = store, fingerprint, max(1, head), resync_s
        self._entries: dict[str, tuple[str, list[int]]] = {}     # key → (tenant fingerprint, token ids)
        self._foreign: set[str] = set()
        self._unread: set[str] = set()           # journaled keys whose entry could not be read yet: tried again
        self._by_head: dict[tuple, list[str]] = defaultdict(list)
        self._cursor: int | None = None
        self._listed_at = 0.0
        self._lock = threading.Lock()            # guards the index (find/place read it from other threads)
        self._refreshing = threading.Lock()      # one refresh at a time: cursor and listing go together

    def refresh(self, full: bool = False) -> None:
        """Learn what was stored since the last call; ``full`` (also the first call, and every ``resync_s``):
        list every key, and forget the deleted ones. An empty listing forgets nothing: a store that cannot be
        reached answers one, and a stale entry costs only a miss."""
        with self._refreshing:
            full = full or self._cursor is None or time.monotonic() - self._listed_at > self.resync_s
            keys, self._cursor = self.store.added_since(None if full else self._cursor)
            if full and keys:
                self._listed_at, present = time.monotonic(), set(keys)
                self._unread &= present
                with self._lock:
                    for key in [k for k in self._entries if k not in present]:
                        fingerprint, ids = self._entries.pop(key)
                        self._by_head[(fingerprint, tuple(ids[: self.head]))].remove(key)
            for key in dict.fromkeys([*keys, *self._unread]):
                if key in self._entries or key in self._foreign:
                    continue
                found = peek_entry(self.store, key)
                if found is None:
                    self._unread.add(key)
                    continue
                self._unread.discard(key)
                ids, named, model = found
                fingerprint = named or self.fingerprint
                if (len(ids) < self.head or chunk_key(fingerprint, ids) != key
                        or self.fingerprint not in (fingerprint, model)):
                    self._foreign.add(key)
                    continue
                with self._lock:
                    self._entries[key] = (fingerprint, ids)
                    self._by_head[(fingerprint, tuple(ids[: self.head]))].append(key)

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, prompt: list[int], fingerprint: str | None = None) -> list[tuple[int, int, str]]:
        """Non-overlapping (start, end, key) of the chunks stored under ``fingerprint`` (a tenant's; default: the
        model's own) in ``prompt``, left to right, longest first.

        A match may cover only a *prefix* of a stored chunk (at least ``head`` tokens): inside a
        prompt a chunk's last token often merges with what follows (a trailing newline before a
        blank line), and by causality the KV of a chunk's first tokens, computed alone, is the same
        whatever came after them — the worker reuses those entries and recomputes the rest.
        """
        found, i, n = [], 0, len(prompt)
        fingerprint = fingerprint or self.fingerprint
        with self._lock:
            while i + self.head <= n:
                best, best_len = None, 0
                for key in self._by_head.get((fingerprint, tuple(prompt[i: i + self.head])), ()):
                    length = _common_prefix(prompt, i, self._entries[key][1])
                    if length > best_len:
                        best, best_len = key, length
                if best is None:
                    i += 1
                    continue
                found.append((i, i + best_len, best))
                i += best_len
        return found

    def place(self, prompt: list[int], keys: list[str], fingerprint: str | None = None
              ) -> tuple[list[tuple[int, int, str]], list[tuple[str, str]]]:
        """Where the chunks a client named by key are in ``prompt``: ``(placed, ignored)``; only chunks stored
        under ``fingerprint`` (a tenant's; default: the model's own) are placed.

        ``placed``: (start, end, key), sorted; a chunk is placed where the longest prefix of its tokens
        (at least ``head``) occurs, as in ``find``. ``ignored``: (key, reason) for every key that is not
        stored, belongs to another model, or whose tokens the prompt does not contain — a name alone
        never makes a reuse.
        """
        placed: list[tuple[int, int, str]] = []
        ignored: list[tuple[str, str]] = []
        fingerprint = fingerprint or self.fingerprint
        with self._lock:
            for key in dict.fromkeys(keys):
                owner, ids = self._entries.get(key, (None, None))
                if owner != fingerprint:
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

