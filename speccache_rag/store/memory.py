"""In-process KV store: an LRU bounded in bytes, for tests, notebooks and a hot tier over disk/redis."""
from __future__ import annotations

import threading
from collections import OrderedDict

from ..config import StoreConfig
from ..kv import ChunkKV, check_key
from .base import KVStore


class MemoryStore(KVStore):
    """Keeps ``ChunkKV`` objects as they are (no serialization), evicting the least recently used
    entries once their tensors exceed ``max_bytes``.

    Entries are shared, not copied: callers must not modify the tensors of what ``get`` returns.
    Safe to use from several threads (the engine and a precompute job may share one store).
    """

    def __init__(self, max_bytes: int = StoreConfig.memory_max_bytes):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()  # oldest first
        # the keys put, in order (added_since): the n-th put has cursor position n; the oldest half is dropped
        # once the journal outgrows the entries, and a reader that far behind lists every key again
        self._journal: list[str] = []
        self._journal_start = 0
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of tensors currently held."""
        return self._bytes

    def get(self, key: str) -> ChunkKV | None:
        check_key(key)
        with self._lock:
            chunk = self._entries.get(key)
            if chunk is not None:
                self._entries.move_to_end(key)
            return chunk

    def put(self, chunk: ChunkKV) -> None:
        check_key(chunk.key)
        with self._lock:
            self._pop(chunk.key)
            # An entry that alone exceeds the bound would evict everything and then itself.
            if chunk.nbytes > self.max_bytes:
                return
            self._entries[chunk.key] = chunk
            self._journal.append(chunk.key)
            if len(self._journal) > 2 * len(self._entries) + 1024:
                drop = len(self._journal) // 2
                del self._journal[:drop]
                self._journal_start += drop
            self._bytes += chunk.nbytes
            while self._bytes > self.max_bytes:
                self._pop(next(iter(self._entries)))

    def contains(self, key: str) -> bool:
        # A membership check is not a use: it must not refresh recency.
        check_key(key)
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._pop(key)

    def added_since(self, cursor: int | None) -> tuple[list[str], int]:
        with self._lock:
            end = self._journal_start + len(self._journal)
            if cursor is None or not self._journal_start <= cursor <= end:
                return list(self._entries), end
            return self._journal[cursor - self._journal_start:], end

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def _pop(self, key: str) -> None:
        chunk = self._entries.pop(key, None)
        if chunk is not None:
            self._bytes -= chunk.nbytes
