"""What ``speccache-rag store stats | verify | gc | export`` do, on any store."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..kv import ChunkKV, CorruptEntry, chunk_key, read_meta
from .base import KVStore
from .disk import DiskStore
from .memory import MemoryStore
from .tiered import TieredStore


def stats(store: KVStore) -> dict:
    """Entries and bytes, in all and per model fingerprint (entries without one: "unknown")."""
    per: dict[str, dict] = {}
    total = count = 0
    for key in store.keys():
        blob = store.raw(key)
        if blob is None:
            continue
        try:
            meta = read_meta(blob)
        except CorruptEntry:
            meta = {}
        fp = str(meta.get("model", meta.get("fingerprint", "unknown")))      # a tenant's entries: its model
        slot = per.setdefault(fp, {"entries": 0, "bytes": 0})
        slot["entries"] += 1
        slot["bytes"] += len(blob)
        total += len(blob)
        count += 1
    out = {"entries": count, "bytes": total, "models": per}
    if isinstance(store, TieredStore):
        out["tiers"] = store.tier_stats()
    return out


@dataclass
class VerifyReport:
    checked: int = 0
    corrupt: list[tuple[str, str]] = field(default_factory=list)       # (key, why)
    unknown_model: list[str] = field(default_factory=list)
    deleted: int = 0

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.unknown_model


def verify(store: KVStore, fingerprints: Iterable[str] = (), delete: bool = False) -> VerifyReport:
    """Read every entry in full: checksum, layout, shapes, and that its key is the content address of its
    own tokens under its own fingerprint. With ``fingerprints``, entries of any other model are reported
    (they can never be read by those models: their keys differ). ``delete`` removes what failed."""
    known = set(fingerprints)
    report = VerifyReport()
    for key in store.keys():
        blob = store.raw(key)
        if blob is None:
            continue
        report.checked += 1
        why = None
        try:
            chunk = ChunkKV.from_bytes(blob, expect_key=key)
            fp = chunk.meta.get("fingerprint")
            if fp is not None and chunk_key(fp, chunk.token_ids, chunk.meta.get("context_ids", ())) != key:
                why = "key is not the content address of the entry's tokens"
            fp = chunk.meta.get("model", fp)            # a tenant's entry belongs to its model
        except CorruptEntry as e:
            why, fp = str(e), None
        if why:
            report.corrupt.append((key, why))
        elif known and fp not in known:
            report.unknown_model.append(key)
        else:
            continue
        if delete:
            store.delete(key)
            report.deleted += 1
    return report


def gc(store: KVStore, max_bytes: int) -> int:
    """Evict least recently used entries until the store holds at most ``max_bytes``; returns bytes freed."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if isinstance(store, TieredStore):
        return sum(gc(t, max_bytes) for t in store.tiers)
    if isinstance(store, DiskStore):
        return DiskStore(store.root, max_bytes=max_bytes).gc()
    keys = store.keys()
    if not isinstance(store, MemoryStore):                     # memory: keys() is least recently used first
        idle = getattr(store, "idle_seconds", lambda k: 0)
        # before any read: on Redis reading a value resets its idle clock
        keys = sorted(keys, key=idle, reverse=True)            # longest idle first
    sizes = {k: len(b) for k in keys if (b := store.raw(k)) is not None}    # in eviction order
    total, freed = sum(sizes.values()), 0
    for key in sizes:
        if total - freed <= max_bytes:
            break
        store.delete(key)
        freed += sizes[key]
    if hasattr(store, "prune_texts"):                          # Redis: texts of entries that expired, and
        store.prune_texts()                                    # journal positions no reader needs any more
        store.compact_journal()
    return freed


def export(src: KVStore, dst: KVStore) -> tuple[int, int]:
    """Copy every valid entry of ``src`` into ``dst`` → (copied, skipped as corrupt or vanished)."""
    copied = skipped = 0
    for key in src.keys():
        chunk = src.get(key)
        if chunk is None:
            skipped += 1
            continue
        dst.put(chunk)
        copied += 1
    return copied, skipped
