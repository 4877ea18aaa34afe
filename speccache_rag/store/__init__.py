"""Chunk KV stores, and ``open_store`` which turns a user's ``store=`` argument into one."""
from __future__ import annotations

import os
from urllib.parse import parse_qs, urlsplit

from ..config import StoreConfig
from .base import KVStore
from .disk import DiskStore
from .memory import MemoryStore
from .tiered import TieredStore

__all__ = ["KVStore", "MemoryStore", "DiskStore", "TieredStore", "open_store"]


def open_store(spec: KVStore | str | os.PathLike, config: StoreConfig | None = None) -> KVStore:
    """A store from ``spec``: a ``KVStore`` (returned as is), ``"memory://"`` (optionally
    ``"memory://?max_bytes=N"``), ``"redis://host:port/db"`` (also ``rediss://``, ``?ttl=SECONDS``), a
    directory path (``str``/``Path``, optionally ``file://``-prefixed), or ``"tiered://A,B,…"`` (fastest
    first, e.g. ``tiered://memory://,./kv,redis://host:6379/0``). Byte bounds default to ``config``'s."""
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

        url, ttl = _pop_query(spec, "ttl")
        try:
            return RedisStore(url, ttl=int(ttl) if ttl is not None else None)
        except ValueError as e:
            raise ValueError(f"invalid redis store {spec!r}: {e}") from None
    if spec.startswith("tiered://"):
        tiers = [t for t in spec[len("tiered://"):].split(",") if t]
        if len(tiers) < 2:
            raise ValueError(f"invalid tiered store {spec!r}: expected 'tiered://FAST,…,SLOW' with 2+ stores, "
                             "e.g. 'tiered://memory://,./kv,redis://host:6379/0'")
        return TieredStore([open_store(t, config) for t in tiers])
    if spec.startswith("file://"):
        return DiskStore(spec[len("file://"):], max_bytes=config.max_bytes)
    if "://" in spec:
        raise ValueError(f"unknown store {spec!r}: use a directory, 'memory://' or 'redis://host:port/db'")
    return DiskStore(spec, max_bytes=config.max_bytes)


def _pop_query(url: str, name: str) -> tuple[str, str | None]:
    """``url`` without its ``name=`` query parameter, and that parameter's value."""
    parts = urlsplit(url)
    pairs = [p for p in parts.query.split("&") if p]
    value = next((p.split("=", 1)[1] for p in pairs if p.startswith(name + "=")), None)
    rest = "&".join(p for p in pairs if not p.startswith(name + "="))
    return parts._replace(query=rest).geturl(), value


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
