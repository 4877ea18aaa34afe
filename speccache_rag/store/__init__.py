"""Chunk KV stores, and ``open_store`` which turns a user's ``store=`` argument into one."""
from __future__ import annotations

import os
from urllib.parse import parse_qs, urlsplit

from ..config import StoreConfig
from .base import KVStore
from .disk import DiskStore
from .memory import MemoryStore

__all__ = ["KVStore", "MemoryStore", "DiskStore", "open_store"]


def open_store(spec: KVStore | str | os.PathLike, config: StoreConfig | None = None) -> KVStore:
    """A store from ``spec``: a ``KVStore`` (returned as is), ``"memory://"`` (optionally
    ``"memory://?max_bytes=N"``), ``"redis://host:port/db"`` (also ``rediss://``), or a directory
    path (``str``/``Path``, optionally ``file://``-prefixed). Byte bounds default to ``config``'s."""
    if isinstance(spec, KVStore):
        return spec
    config = config or StoreConfig()
    if isinstance(spec, os.PathLike):
        return DiskStore(spec, max_bytes=config.max_bytes)
    if not isinstance(spec, str):
        raise TypeError(f"store must be a KVStore, a path or a URL string, got {type(spec).__name__}")
    if spec.startswith("memory://"):
        return MemoryStore(max_bytes=_memory_bound(spec, config.memory_max_bytes))
    if spec.startswith(("redis://", "rediss://")):
        from .redis_store import RedisStore  # lazy: the redis package is an optional extra

        return RedisStore(spec)
    if spec.startswith("file://"):
        return DiskStore(spec[len("file://"):], max_bytes=config.max_bytes)
    if "://" in spec:
        raise ValueError(f"unknown store {spec!r}: use a directory, 'memory://' or 'redis://host:port/db'")
    return DiskStore(spec, max_bytes=config.max_bytes)


def _memory_bound(spec: str, default: int) -> int:
    parts = urlsplit(spec)
    query = parse_qs(parts.query, strict_parsing=bool(parts.query))
    if parts.netloc or parts.path or set(query) - {"max_bytes"}:
        raise ValueError(f"invalid memory store {spec!r}: expected 'memory://' or 'memory://?max_bytes=N'")
    if "max_bytes" not in query:
        return default
    try:
        return int(query["max_bytes"][-1])
    except ValueError:
        raise ValueError(f"invalid max_bytes in {spec!r}: expected an integer") from None
