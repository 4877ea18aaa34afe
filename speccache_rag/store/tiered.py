"""A tiered store: fast tiers in front of slow ones (memory → disk → redis), with per-tier counters."""
from __future__ import annotations

import threading
from collections.abc import Sequence

from ..kv import ChunkKV, check_key
from .base import KVStore


class TieredStore(KVStore):
    """``tiers`` fastest first. A read walks down until a tier has the entry and copies it into every
    faster tier; a write goes through to all. Each tier keeps its own byte bound and LRU (a memory
    LRU, the directory's gc, Redis's maxmemory policy), so a hot entry lives in the fast tiers and a
    cold one only in the slow. ``tier_stats()`` counts hits and misses per tier."""

    def __init__(self, tiers: Sequence[KVStore]):
        if len(tiers) < 1:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
        self._hits = [0] * len(self.tiers)
        self._misses = [0] * len(self.tiers)
        self._lock = threading.Lock()

    def get(self, key: str) -> ChunkKV | None:
        check_key(key)
        for i, tier in enumerate(self.tiers):
            chunk = tier.get(key)
            with self._lock:
                (self._hits if chunk is not None else self._misses)[i] += 1
            if chunk is not None:
                for faster in self.tiers[:i]:
                    faster.put(chunk)
                return chunk
        return None

    def put(self, chunk: ChunkKV) -> None:
        for tier in self.tiers:
            tier.put(chunk)

    def contains(self, key: str) -> bool:
        return any(tier.contains(key) for tier in self.tiers)

    def delete(self, key: str) -> None:
        for tier in self.tiers:
            tier.delete(key)

    def keys(self) -> list[str]:
        return list(dict.fromkeys(k for tier in reversed(self.tiers) for k in tier.keys()))

    def texts(self, keys: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for tier in self.tiers:
            out.update(tier.texts([k for k in keys if k not in out]))
        return out

    def get_meta(self, name: str) -> dict | None:
        return next((v for t in self.tiers if (v := t.get_meta(name)) is not None), None)

    def put_meta(self, name: str, value: dict) -> None:
        for tier in self.tiers:
            tier.put_meta(name, value)

    def tier_stats(self) -> list[dict]:
        with self._lock:
            return [{"tier": type(t).__name__, "hits": h, "misses": m}
                    for t, h, m in zip(self.tiers, self._hits, self._misses)]

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
