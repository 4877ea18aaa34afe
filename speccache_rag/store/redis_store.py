"""Redis KV store: chunk caches shared by every engine and server pointed at one Redis.

The cache is an accelerator, never a dependency: if Redis is down the engine must still answer, so
this store degrades to an always-miss store (full prefill) instead of raising into the caller.
"""
from __future__ import annotations

import json
import threading
import time
import warnings
from typing import Callable, TypeVar

from ..kv import ChunkKV, CorruptEntry, check_key
from .base import KVStore

PREFIX = "speccache:kv:"
META_PREFIX = "speccache:meta:"
TEXTS = "speccache:texts"           # key → chunk text, for every replica's prompt matching
JOURNAL = "speccache:journal"       # every key put, in order (added_since reads it from an index)
JOURNAL_START = "speccache:journal:start"   # the journal position of the list's first item (compaction moves it)
T = TypeVar("T")


def _import_redis():
    try:
        import redis
    except ImportError as e:
        raise ImportError("the redis store needs the 'redis' extra: pip install 'speccache-rag[redis]'") from e
    return redis


class RedisStore(KVStore):
    """Values are ``ChunkKV.to_bytes()`` blobs under ``speccache:kv:<key>``.

    Eviction is Redis's own business (configure ``maxmemory`` and ``maxmemory-policy allkeys-lru``);
    ``ttl`` (seconds; ``redis://…?ttl=N``) also expires entries. ``rediss://`` and ``redis://user:pass@…``
    are redis-py's TLS and auth.
    While the server is unreachable every call is a miss and puts are dropped; a reconnect is tried
    at most every ``retry_interval`` seconds so a dead server costs nothing on the hot path.
    """

    def __init__(self, url: str, *, ttl: int | None = None, retry_interval: float = 5.0,
                 connect_timeout: float = 1.0, socket_timeout: float = 10.0):
        redis = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl}")
        self.ttl, self.retry_interval = ttl, retry_interval
        # One immediate retry reconnects a pooled socket that died with a server restart; more
        # (redis-py's defaults vary by version) would multiply the connect timeout on a dead server.
        self._client = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout,
                                            socket_timeout=socket_timeout, retry=Retry(NoBackoff(), 1))
        # Errors meaning "no usable Redis there": back off. Others are per-operation failures.
        self._down_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                             redis.exceptions.InvalidResponse)
        self._redis_error = redis.exceptions.RedisError
        self._retry_at = 0.0  # monotonic time before which the server is presumed down
        self._warned = False
        self._lock = threading.Lock()
        # Probe now so a misconfigured URL is reported at startup, not at the first query.
        self._call(self._client.ping, False)

    @property
    def available(self) -> bool:
        """False while the server is presumed down (between failed attempts)."""
        return time.monotonic() >= self._retry_at

    def get(self, key: str) -> ChunkKV | None:
        blob = self._call(lambda: self._client.get(PREFIX + check_key(key)), None)
        if blob is None:
            return None
        try:
            return ChunkKV.from_bytes(blob, expect_key=key)
        except CorruptEntry as e:
            warnings.warn(f"discarding corrupt KV entry {PREFIX + key} in Redis at {self._where()}: {e}",
                          stacklevel=2)
            self.delete(key)
            return None

    def put(self, chunk: ChunkKV) -> None:
        blob = chunk.to_bytes()
        text = chunk.meta.get("text")

        def write():   # one transaction: the entry and its text appear together, never half-written
            pipe = self._client.pipeline(transaction=True)
            pipe.set(PREFIX + chunk.key, blob, ex=self.ttl)
            if isinstance(text, str):
                pipe.hset(TEXTS, chunk.key, text)
            pipe.rpush(JOURNAL, chunk.key)
            pipe.execute()
        self._call(write, None)

    def raw(self, key: str) -> bytes | None:
        return self._call(lambda: self._client.get(PREFIX + check_key(key)), None)

    def idle_seconds(self, key: str) -> int:
        """Seconds since the entry was last read or written (Redis's own LRU clock)."""
        return int(self._call(lambda: self._client.object("idletime", PREFIX + check_key(key)), 0) or 0)

    def texts(self, keys: list[str]) -> dict[str, str]:
        """From the shared text index; entries written before it existed are read whole."""
        keys = [check_key(k) for k in keys]
        values = self._call(lambda: self._client.hmget(TEXTS, keys), None) if keys else []
        if values is None:
            return {}
        out = {k: v.decode("utf-8") for k, v in zip(keys, values) if v is not None}
        return {**out, **super().texts([k for k in keys if k not in out])}

    def prune_texts(self) -> int:
        """Drop index texts whose entry is gone (expired by TTL or evicted by Redis); → how many."""
        live = set(self.keys())
        stale = [k.decode() for k in self._call(lambda: self._client.hkeys(TEXTS), []) if k.decode() not in live]
        if stale:
            self._call(lambda: self._client.hdel(TEXTS, *stale), 0)
        return len(stale)

    def get_meta(self, name: str) -> dict | None:
        value = self._call(lambda: self._client.get(META_PREFIX + check_key(name)), None)
        try:
            return json.loads(value) if value is not None else None
        except ValueError:
            return None

    def put_meta(self, name: str, value: dict) -> None:
        self._call(lambda: self._client.set(META_PREFIX + check_key(name), json.dumps(value)), None)

    def contains(self, key: str) -> bool:
        return bool(self._call(lambda: self._client.exists(PREFIX + check_key(key)), 0))

    def delete(self, key: str) -> None:
        def drop():
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(PREFIX + check_key(key))
            pipe.hdel(TEXTS, key)
            pipe.execute()
        self._call(drop, None)

    def added_since(self, cursor: int | None) -> tuple[list[str], int | None]:
        def read() -> tuple[list[str], int | None]:
            start, length = self._journal_bounds()
            if cursor is None or not start <= cursor <= start + length:   # first read, a flush, or compacted past it
                return self._scan(), start + length     # a failing scan fails the call: never an empty listing
            new = [k.decode() for k in self._client.lrange(JOURNAL, cursor - start, -1)]
            if self._journal_bounds()[0] != start:      # compacted while reading: the positions moved
                end = sum(self._journal_bounds())
                return self._scan(), end
            return new, cursor + len(new)
        return self._call(read, ([], cursor))

    def _journal_bounds(self) -> tuple[int, int]:
        start, length = self._client.pipeline(transaction=True).get(JOURNAL_START).llen(JOURNAL).execute()
        return int(start or 0), int(length)

    def compact_journal(self, keep: int = 1024) -> int:
        """Drop the journal's oldest positions beyond ``keep`` + the live entries; → how many. A reader whose
        cursor they held lists every key once, then follows the journal again."""
        def trim() -> int:
            drop = self._client.llen(JOURNAL) - max(keep, len(self.keys()))
            if drop <= 0:
                return 0
            self._client.pipeline(transaction=True).ltrim(JOURNAL, drop, -1).incrby(JOURNAL_START, drop).execute()
            return drop
        return self._call(trim, 0)

    def keys(self) -> list[str]:
        return self._call(self._scan, [])

    def _scan(self) -> list[str]:
        # SCAN, not KEYS: KEYS blocks a shared server for as long as it walks the keyspace.
        return [k.decode()[len(PREFIX):] for k in self._client.scan_iter(match=PREFIX + "*", count=1000)]

    def close(self) -> None:
        self._client.close()

    def _call(self, op: Callable[[], T], fallback: T) -> T:
        """Run one Redis operation; on any Redis failure return ``fallback`` instead of raising."""
        if not self.available:
            return fallback
        try:
            return op()
        except self._down_errors:
            with self._lock:
                self._retry_at = time.monotonic() + self.retry_interval
                first = not self._warned
                self._warned = True
            if first:
                warnings.warn(f"Redis at {self._where()} is unreachable; KV reuse disabled, "
                              "falling back to full prefill", stacklevel=3)
            return fallback
        except self._redis_error as e:
            # Reachable but refusing (e.g. OOM under maxmemory with noeviction): a miss, not a crash.
            warnings.warn(f"Redis at {self._where()} failed a KV operation: {e}", stacklevel=3)
            return fallback

    def _where(self) -> str:
        kw = self._client.connection_pool.connection_kwargs
        if "path" in kw:
            return kw["path"]
        return f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
