"""KV store backends: round trips, bounds, atomic writes, corruption handling, Redis outages."""
from __future__ import annotations

import builtins
import os
import pickle
import shutil
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from speccache_rag.kv import ChunkKV
from speccache_rag.store import DiskStore, KVStore, MemoryStore, open_store

from redis_server import NO_REDIS_PY, free_port, start_redis, stop

LAYERS, HEADS, DIM = 2, 2, 8


def make_chunk(key: str, tokens: int = 4, text: str | None = None) -> ChunkKV:
    shape = (LAYERS, HEADS, tokens, DIM)
    meta = {"text": text} if text is not None else {}
    return ChunkKV(key=key, token_ids=list(range(tokens)), k=torch.randn(shape), v=torch.randn(shape), meta=meta)


def assert_same(a: ChunkKV | None, b: ChunkKV) -> None:
    assert a is not None
    assert a.key == b.key and a.token_ids == b.token_ids and a.meta == b.meta
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@pytest.fixture
def redis_store(redis_url):
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    from speccache_rag.store.redis_store import RedisStore

    store = RedisStore(redis_url)
    yield store
    store.close()


@pytest.fixture(params=["memory", "disk", "redis"])
def store(request, tmp_path) -> KVStore:
    if request.param == "memory":
        return MemoryStore(max_bytes=1 << 20)
    if request.param == "disk":
        return DiskStore(tmp_path / "kv", max_bytes=1 << 20)
    return request.getfixturevalue("redis_store")


# --- every backend -----------------------------------------------------------------------------

def test_round_trip(store):
    chunk = make_chunk("ab" + "0" * 62, text="the chunk's text")
    assert store.get(chunk.key) is None and not store.contains(chunk.key)
    store.put(chunk)
    assert store.contains(chunk.key)
    assert_same(store.get(chunk.key), chunk)
    assert store.keys() == [chunk.key]


def test_the_text_index_follows_the_store_without_listing_it_again(store, monkeypatch):
    """After its first sync the chunk-text index reads only what was added (the store's journal): the cost of a
    query's sync does not grow with the store (bench: python -m speccache_rag.bench.lookup)."""
    from speccache_rag.matching import ChunkTextIndex

    text = "chunk number {} of the journal test, long enough to be matched by content"
    for i in range(3):
        store.put(make_chunk(f"jr{i:02d}", text=text.format(i)))
    index = ChunkTextIndex()
    assert index.sync(store) == 3 and index.sync(store) == 0
    monkeypatch.setattr(type(store), "keys", lambda self: pytest.fail("a sync listed every key"))
    store.put(make_chunk("jr03", text=text.format(3)))
    assert index.sync(store) == 1 and text.format(3) in index
    assert index.sync(store) == 0


def test_a_store_written_before_the_journal_is_read_whole_once(tmp_path):
    from speccache_rag.matching import ChunkTextIndex

    store = DiskStore(tmp_path / "kv")
    store.put(make_chunk("jr10", text="an entry stored by a version without the journal, long enough"))
    (tmp_path / "kv" / "journal.log").unlink()
    index = ChunkTextIndex()
    assert index.sync(store) == 1                              # the first sync lists the store
    store.put(make_chunk("jr11", text="an entry stored after it, which the journal alone now tells"))
    assert index.sync(store) == 1


def test_the_memory_journal_stays_bounded_and_a_reader_left_behind_lists_again():
    store = MemoryStore()
    store.put(make_chunk("bb00"))
    seen, cursor = store.added_since(None)
    for _ in range(2999):                         # overwrites: 3000 puts, one entry
        store.put(make_chunk("bb01"))
    assert len(store._journal) <= 2 * len(store._entries) + 1024
    keys, _ = store.added_since(cursor)           # its position was dropped: every key, not a gap
    assert seen == ["bb00"] and sorted(keys) == ["bb00", "bb01"]
    _, now = store.added_since(None)
    store.put(make_chunk("bb02"))
    assert store.added_since(now) == (["bb02"], now + 1)


def test_put_overwrites_and_delete(store):
    first, second = make_chunk("cd01"), make_chunk("cd01", tokens=6)
    store.put(first)
    store.put(second)
    assert_same(store.get("cd01"), second)
    store.delete("cd01")
    store.delete("cd01")  # deleting a missing key is not an error
    assert store.get("cd01") is None and store.keys() == []


# --- memory ------------------------------------------------------------------------------------

def test_memory_lru_eviction_by_bytes():
    size = make_chunk("x0").nbytes
    store = MemoryStore(max_bytes=3 * size)
    for i in range(3):
        store.put(make_chunk(f"k{i}"))
    store.get("k0")  # k0 becomes most recent, so k1 is now the oldest
    store.put(make_chunk("k3"))
    assert store.keys() == ["k2", "k0", "k3"]
    assert store.nbytes == 3 * size
    store.put(make_chunk("big", tokens=8))  # two entries' worth: evicts the two oldest
    assert store.keys() == ["k3", "big"] and store.nbytes == 3 * size


def test_memory_refuses_entry_larger_than_bound():
    store = MemoryStore(max_bytes=make_chunk("a").nbytes)
    store.put(make_chunk("small"))
    store.put(make_chunk("small", tokens=64))  # the oversized replacement drops the old value too
    assert store.keys() == [] and store.nbytes == 0


# --- disk --------------------------------------------------------------------------------------

def test_disk_layout_and_no_temp_files(tmp_path):
    store = DiskStore(tmp_path, max_bytes=1 << 20)
    key = "abcdef" + "1" * 58
    store.put(make_chunk(key))
    store.put(make_chunk(key))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "ab", f"ab/{key}.safetensors", "journal.log"]
    assert (tmp_path / "journal.log").read_text() == f"{key}\n{key}\n"        # one line per put


def test_disk_failed_write_leaves_nothing(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, max_bytes=1 << 20)
    old = make_chunk("ab01")
    store.put(old)

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        store.put(make_chunk("ab01", tokens=6))
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["ab01.safetensors", "journal.log"]
    assert (tmp_path / "journal.log").read_text() == "ab01\n"                  # the failed put is not journaled
    assert_same(store.get("ab01"), old)


def damage_flip(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0xFF  # inside the tensor data: only the checksum can tell
    path.write_bytes(bytes(blob))


def damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def damage_garbage(path: Path) -> None:
    path.write_bytes(os.urandom(300))


def damage_empty(path: Path) -> None:
    path.write_bytes(b"")


def test_entries_written_with_a_sha256_checksum_are_still_read_and_checked(monkeypatch):
    """Entries written before the CRC-32 carry a bare SHA-256 digest: still valid, still checked."""
    import speccache_rag.kv as kv

    chunk, crc = make_chunk("ab05"), kv._checksum
    monkeypatch.setattr(kv, "_checksum", lambda k, v, like=None: crc(k, v, like="0"))  # a bare digest: SHA-256
    old = chunk.to_bytes()
    monkeypatch.setattr(kv, "_checksum", crc)
    assert old != chunk.to_bytes()
    assert_same(ChunkKV.from_bytes(old), chunk)
    damaged = bytearray(old)
    damaged[-5] ^= 0xFF
    with pytest.raises(kv.CorruptEntry, match="checksum"):
        ChunkKV.from_bytes(bytes(damaged))


@pytest.mark.parametrize("damage", [damage_flip, damage_truncate, damage_garbage, damage_empty])
def test_disk_corrupt_entry_is_a_miss_then_recovers(tmp_path, damage):
    store = DiskStore(tmp_path, max_bytes=1 << 20)
    chunk = make_chunk("ab02")
    store.put(chunk)
    path = store.path("ab02")
    damage(path)
    with pytest.warns(UserWarning, match="ab02.safetensors"):
        assert store.get("ab02") is None
    assert not path.exists() and not store.contains("ab02")
    store.put(chunk)
    assert_same(store.get("ab02"), chunk)


def test_disk_wrong_key_in_file_is_a_miss(tmp_path):
    store = DiskStore(tmp_path, max_bytes=1 << 20)
    store.put(make_chunk("ab03"))
    store.path("ab04").write_bytes(store.path("ab03").read_bytes())
    with pytest.warns(UserWarning, match="expected"):
        assert store.get("ab04") is None
    assert not store.path("ab04").exists()
    assert store.get("ab03") is not None


class _Payload:
    """Unpickling this runs code; a store that unpickles would set the flag."""

    def __reduce__(self):
        return exec, ("import builtins; builtins._speccache_unpickled = True",)


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_disk_never_unpickles(tmp_path, writer):
    store = DiskStore(tmp_path, max_bytes=1 << 20)
    path = store.path("ab05")
    path.parent.mkdir(parents=True)
    if writer == "pickle":
        path.write_bytes(pickle.dumps(_Payload()))
    else:
        torch.save({"k": torch.zeros(1), "payload": _Payload()}, path)
    try:
        with pytest.warns(UserWarning, match="corrupt"):
            assert store.get("ab05") is None
        assert not hasattr(builtins, "_speccache_unpickled")
    finally:
        builtins.__dict__.pop("_speccache_unpickled", None)


def test_disk_gc_keeps_most_recent_within_budget(tmp_path):
    entry = len(make_chunk("ab77").to_bytes())           # keys of one length: entries of one size
    store = DiskStore(tmp_path, max_bytes=4 * entry)
    keys = [f"ab{i:02d}" for i in range(4)]
    for i, key in enumerate(keys):
        store.put(make_chunk(key))
        os.utime(store.path(key), ns=(i * 10**9, i * 10**9))  # deterministic age order
    store.get("ab00")  # a read refreshes mtime: ab00 is now the most recent
    store.put(make_chunk("ab99"))  # over budget: gc drops the oldest until below it
    remaining = set(store.keys())
    assert "ab00" in remaining and "ab99" in remaining and "ab01" not in remaining
    total = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
    assert total <= store.max_bytes


def test_disk_gc_explicit_and_size_tracking(tmp_path):
    entry = len(make_chunk("x0").to_bytes())
    big = DiskStore(tmp_path, max_bytes=100 * entry)
    for i in range(10):
        big.put(make_chunk(f"ab{i:02d}"))
    small = DiskStore(tmp_path, max_bytes=3 * entry)  # e.g. the budget was lowered
    assert small.gc() > 0
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors")) <= 3 * entry
    assert small.gc() == 0


def test_disk_gc_removes_stale_temp_files_only(tmp_path):
    store = DiskStore(tmp_path, max_bytes=1 << 20)
    store.put(make_chunk("ab06"))
    stale, fresh = tmp_path / "ab" / ".ab07.x.tmp", tmp_path / "ab" / ".ab08.y.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")  # may belong to a writer in another process right now
    os.utime(stale, (0, 0))
    store.gc()
    assert not stale.exists() and fresh.exists() and store.keys() == ["ab06"]


def test_disk_refuses_entry_larger_than_budget(tmp_path):
    store = DiskStore(tmp_path, max_bytes=100)
    store.put(make_chunk("ab09"))
    assert store.keys() == []


@pytest.mark.parametrize("key", ["../evil", "a", "ab/cd", ".hidden", "ab cd", ""])
def test_disk_rejects_unsafe_keys(tmp_path, key):
    with pytest.raises(ValueError, match="invalid chunk key"):
        DiskStore(tmp_path).get(key)


# --- redis -------------------------------------------------------------------------------------

def test_redis_journal_compaction_keeps_positions_and_sends_readers_behind_it_to_a_listing(redis_store):
    store = redis_store
    store.put(make_chunk("cc00"))
    _, old = store.added_since(None)
    for _ in range(1100):
        store.put(make_chunk("cc01"))
    _, recent = store.added_since(None)
    store.put(make_chunk("cc02"))
    assert store.compact_journal(keep=10) == 1102 - 10
    assert store.added_since(recent) == (["cc02"], recent + 1)        # positions are absolute: kept readers read on
    keys, now = store.added_since(old)                                # a reader behind the trim lists every key
    assert sorted(keys) == ["cc00", "cc01", "cc02"] and now == recent + 1
    store.put(make_chunk("cc03"))
    assert store.added_since(now) == (["cc03"], now + 1)


def test_redis_value_layout(redis_store, redis_url):
    import redis

    chunk = make_chunk("ab10")
    redis_store.put(chunk)
    assert redis.Redis.from_url(redis_url).get("speccache:kv:ab10") == chunk.to_bytes()


@pytest.mark.parametrize("value", [b"garbage", b"", pickle.dumps(_Payload())])
def test_redis_corrupt_value_is_a_miss_then_recovers(redis_store, redis_url, value):
    import redis

    chunk = make_chunk("ab11")
    redis.Redis.from_url(redis_url).set("speccache:kv:ab11", value)
    try:
        with pytest.warns(UserWarning, match="corrupt"):
            assert redis_store.get("ab11") is None
        assert not redis_store.contains("ab11") and not hasattr(builtins, "_speccache_unpickled")
    finally:
        builtins.__dict__.pop("_speccache_unpickled", None)
    redis_store.put(chunk)
    assert_same(redis_store.get("ab11"), chunk)


def test_redis_wrong_key_is_a_miss(redis_store, redis_url):
    import redis

    redis.Redis.from_url(redis_url).set("speccache:kv:ab12", make_chunk("ab13").to_bytes())
    with pytest.warns(UserWarning, match="expected"):
        assert redis_store.get("ab12") is None


def test_redis_down_is_an_always_miss_store_and_warns_once():
    pytest.importorskip("redis", reason=NO_REDIS_PY)
    from speccache_rag.store.redis_store import RedisStore

    port = free_port()  # bound then released: nothing listens there
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = RedisStore(f"redis://127.0.0.1:{port}/0", retry_interval=0.0)
        store.put(make_chunk("ab14"))
        assert store.get("ab14") is None
        assert not store.contains("ab14") and store.keys() == []
        store.delete("ab14")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert f"127.0.0.1:{port}" in messages[0] and "unreachable" in messages[0]
    assert "full prefill" in messages[0]


def test_redis_reconnects_after_outage(tmp_path):
    pytest.importorskip("redis", reason=NO_REDIS_PY)
    from speccache_rag.store.redis_store import RedisStore

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    port = free_port()
    with pytest.warns(UserWarning, match="unreachable"):
        store = RedisStore(f"redis://127.0.0.1:{port}/0", retry_interval=0.2)
    assert not store.available
    proc = start_redis(port, tmp_path)
    try:
        chunk = make_chunk("ab15")
        store.put(chunk)  # still inside the back-off window: dropped without trying
        assert store.get("ab15") is None
        time.sleep(0.25)
        store.put(chunk)
        assert_same(store.get("ab15"), chunk)
    finally:
        store.close()
        stop(proc)


# --- open_store --------------------------------------------------------------------------------

def test_open_store_specs(tmp_path):
    mem = MemoryStore()
    assert open_store(mem) is mem
    assert isinstance(open_store("memory://"), MemoryStore)
    assert open_store("memory://?max_bytes=1234").max_bytes == 1234
    for spec in (tmp_path / "a", str(tmp_path / "b"), f"file://{tmp_path / 'c'}"):
        store = open_store(spec)
        assert isinstance(store, DiskStore) and store.root.is_dir()


def test_open_store_defaults_come_from_config(tmp_path):
    from speccache_rag.config import StoreConfig

    cfg = StoreConfig(max_bytes=111, memory_max_bytes=222)
    assert open_store(tmp_path, cfg).max_bytes == 111
    assert open_store("memory://", cfg).max_bytes == 222
    assert open_store("memory://").max_bytes == StoreConfig().memory_max_bytes


def test_open_store_redis(redis_url):
    from speccache_rag.store.redis_store import RedisStore

    store = open_store(redis_url)
    assert isinstance(store, RedisStore) and store.available
    store.close()


@pytest.mark.parametrize("spec", ["s3://bucket/kv", "memory://?max_bytes=lots", "memory://?size=3", "memory://x"])
def test_open_store_rejects_bad_specs(spec):
    with pytest.raises(ValueError):
        open_store(spec)


def test_redis_missing_extra_is_actionable(monkeypatch):
    from speccache_rag.store import redis_store

    monkeypatch.setitem(sys.modules, "redis", None)  # makes `import redis` fail
    with pytest.raises(ImportError, match=r"pip install 'speccache-rag\[redis\]'"):
        redis_store.RedisStore("redis://127.0.0.1:1/0")
