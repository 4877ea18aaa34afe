"""Directory KV store: one safetensors file per chunk, shared safely by several processes."""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import warnings
from pathlib import Path

from ..config import StoreConfig
from ..kv import HEADER_LIMIT, ChunkKV, CorruptEntry, check_key, read_meta
from .base import KVStore

_SUFFIX = ".safetensors"
_META_DIR = "meta"          # JSON records beside the entries (no entry shard has a 4-letter name)
_TMP_SUFFIX = ".tmp"
_JOURNAL = "journal.log"    # one line per put, appended (added_since reads it from a byte offset)
# A writer that crashed leaves its temp file behind; one this old is certainly abandoned.
_STALE_TMP_S = 3600.0
# gc goes this far below the budget so that a store sitting at its bound is not rescanned on every put.
_GC_LOW_WATER = 0.9


class DiskStore(KVStore):
    """``root/ab/abcdef….safetensors`` holding ``ChunkKV.to_bytes()``.

    Writes are atomic (temp file in the same directory, then ``os.replace``), so readers in other
    processes see either the old entry or the new one, never half of one. A damaged entry (torn by a
    crash, edited, wrong key) is reported, deleted and treated as a miss; the caller recomputes.
    Reads refresh the file's mtime, which ``gc`` uses as its LRU order.
    """

    def __init__(self, root: str | os.PathLike, max_bytes: int = StoreConfig.max_bytes):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._size: int | None = None  # bytes on disk; scanned on first put, then tracked
        self._lock = threading.Lock()

    def path(self, key: str) -> Path:
        """Where ``key``'s entry lives."""
        return self.root / check_key(key)[:2] / f"{key}{_SUFFIX}"

    def get(self, key: str) -> ChunkKV | None:
        path = self.path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            chunk = ChunkKV.from_bytes(blob, expect_key=key)
        except CorruptEntry as e:
            warnings.warn(f"discarding corrupt KV entry {path}: {e}", stacklevel=2)
            self._unlink(path)
            return None
        try:
            os.utime(path)
        except FileNotFoundError:  # deleted by a concurrent gc; the data we read is still good
            pass
        return chunk

    def put(self, chunk: ChunkKV) -> None:
        path = self.path(chunk.key)
        blob = chunk.to_bytes()
        # An entry that alone exceeds the budget would make gc flush the whole store, itself last.
        if len(blob) > self.max_bytes:
            return
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{chunk.key[:16]}.", suffix=_TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            # No fsync: this is a cache, and a torn file after power loss fails its checksum (a miss).
            replaced = _size_or_zero(path)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        # one short line in append mode is one write(): lines of concurrent writers never interleave
        with open(self.root / _JOURNAL, "a") as journal:
            journal.write(chunk.key + "\n")
        with self._lock:
            if self._size is None:
                self._size = self._scan_size()
            else:
                self._size += len(blob) - replaced
            over = self._size > self.max_bytes
        if over:
            self.gc()

    def raw(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def entry_meta(self, key: str) -> dict | None:
        """An entry's JSON metadata from the file's header only (no tensors read); None when the entry
        vanished, is torn or is not ours."""
        try:
            with open(self.path(key), "rb") as f:
                head = f.read(8)
                return read_meta(head + f.read(min(int.from_bytes(head, "little"), HEADER_LIMIT)))
        except (OSError, CorruptEntry):
            return None

    def texts(self, keys: list[str]) -> dict[str, str]:
        out = {}
        for key in keys:
            text = (self.entry_meta(key) or {}).get("text")
            if isinstance(text, str):
                out[key] = text
        return out

    def get_meta(self, name: str) -> dict | None:
        try:
            return json.loads((self.root / _META_DIR / f"{check_key(name)}.json").read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            return None

    def put_meta(self, name: str, value: dict) -> None:
        path = self.root / _META_DIR / f"{check_key(name)}.json"
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=_TMP_SUFFIX)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f)
        os.replace(tmp, path)

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        self._unlink(self.path(key))

    def keys(self) -> list[str]:
        return [p.name[: -len(_SUFFIX)] for p, _ in self._entries()]

    def added_since(self, cursor: int | None) -> tuple[list[str], int]:
        if cursor is None or _size_or_zero(self.root / _JOURNAL) < cursor:   # first read, or the journal was reset:
            # every entry (also those of writers before the journal), then follow it
            end = _size_or_zero(self.root / _JOURNAL)
            return self.keys(), end
        try:
            with open(self.root / _JOURNAL, "rb") as journal:
                journal.seek(cursor)
                data = journal.read()
        except FileNotFoundError:
            return [], 0
        done = data.rfind(b"\n") + 1                   # a line still being written is read next time
        return [k.decode() for k in data[:done].split()], cursor + done

    def gc(self) -> int:
        """Delete least recently used entries until the store fits its budget; returns bytes freed.

        Rescans the tree, so it also corrects the tracked size for other processes' writes.
        """
        with self._lock:
            files, total = [], 0
            for path, st in self._entries():
                files.append((st.st_mtime_ns, st.st_size, path))
                total += st.st_size
            self._remove_stale_tmp()
            freed = 0
            if total > self.max_bytes:
                target = int(self.max_bytes * _GC_LOW_WATER)
                for _, size, path in sorted(files):
                    if total - freed <= target:
                        break
                    path.unlink(missing_ok=True)
                    freed += size
            self._size = total - freed
            return freed

    def _entries(self):
        """(path, stat) of every entry, skipping ones that vanish mid-scan (other processes)."""
        for shard in _scandir(self.root):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for e in _scandir(shard.path):
                if e.name.endswith(_SUFFIX) and not e.name.startswith("."):
                    try:
                        yield Path(e.path), e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue

    def _remove_stale_tmp(self) -> None:
        cutoff = time.time() - _STALE_TMP_S
        for shard in _scandir(self.root):
            if shard.is_dir(follow_symlinks=False):
                for e in _scandir(shard.path):
                    if e.name.endswith(_TMP_SUFFIX) and _mtime_or_now(e) < cutoff:
                        Path(e.path).unlink(missing_ok=True)

    def _scan_size(self) -> int:
        return sum(st.st_size for _, st in self._entries())

    def _unlink(self, path: Path) -> None:
        size = _size_or_zero(path)
        path.unlink(missing_ok=True)
        with self._lock:
            if self._size is not None:
                self._size = max(0, self._size - size)


def _scandir(path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _mtime_or_now(entry: os.DirEntry) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return time.time()
