"""The fault suite (docs/reliability.md): nothing wrong is ever served, whatever happens to the store."""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from speccache_rag import RAGPrompt, ReuseConfig, SpecCacheEngine
from speccache_rag.cli import main as cli
from speccache_rag.kv import ChunkKV, chunk_key
from speccache_rag.store import DiskStore, MemoryStore, TieredStore, admin, open_store

import store_worker
from redis_server import start_redis, stop

HERE = Path(__file__).parent
CHUNKS = ["The Brennock harbour ferry is captained by Ilsa Marrow, who took over in 2019.",
          "Kettlewick Cooperative has 212 members and meets every second Tuesday.",
          "The old lighthouse at Dunmere was converted into a museum of maritime maps."]
QUESTION = "How many members does the Kettlewick Cooperative have?"


def _redis(url: str, **kw):
    import redis

    redis.Redis.from_url(url).flushdb()
    from speccache_rag.store.redis_store import RedisStore

    return RedisStore(url, **kw)


@pytest.fixture(params=["disk", "redis"])
def shared_store(request, tmp_path):
    if request.param == "disk":
        return DiskStore(tmp_path / "kv")
    return _redis(request.getfixturevalue("redis_url"))


def _raw_set(store, key: str, blob: bytes) -> None:
    if isinstance(store, DiskStore):
        store.path(key).write_bytes(blob)
    else:
        store._client.set("speccache:kv:" + key, blob)


def _damage(blob: bytes, how: str) -> bytes:
    if how == "truncated":
        return blob[: len(blob) // 2]
    if how == "flipped":
        b = bytearray(blob)
        b[-10] ^= 0x40
        return bytes(b)
    n = int.from_bytes(blob[:8], "little")
    header = blob[8:8 + n].replace(b'"dtype":"F32"', b'"dtype":"F16"', 1)   # same length, half the bytes
    assert header != blob[8:8 + n]
    return blob[:8] + header + blob[8 + n:]


@pytest.mark.parametrize("how", ["truncated", "flipped", "header"])
def test_a_damaged_entry_is_a_miss_recomputed_and_the_answer_is_the_no_store_answer(smollm2, shared_store, how):
    engine = SpecCacheEngine(*smollm2, store=shared_store)
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    keys = engine.precompute(CHUNKS)
    _raw_set(shared_store, keys[0], _damage(shared_store.raw(keys[0]), how))
    with pytest.warns(UserWarning, match="corrupt"):
        damaged = engine.generate(prompt, max_new_tokens=8, return_first_logits=True)
    assert damaged.stats.cache_misses == 1 and damaged.stats.cache_hits == 2
    assert shared_store.get(keys[0]) is not None                    # recomputed and stored back
    shared_store.delete(keys[0])                                    # the same store without that entry
    absent = engine.generate(prompt, max_new_tokens=8, return_first_logits=True)
    assert absent.stats.cache_misses == 1
    assert damaged.token_ids == absent.token_ids
    torch.testing.assert_close(damaged.first_logits, absent.first_logits)


def test_another_models_entries_are_never_read_and_verify_names_them(smollm2, tmp_path, capsys):
    store = DiskStore(tmp_path / "kv")
    other = store_worker.engine(store)                              # a random-weight llama, same tokenizer
    other_keys = other.precompute(CHUNKS)
    engine = SpecCacheEngine(*smollm2, store=store)
    out = engine.generate(RAGPrompt(chunks=CHUNKS, question=QUESTION), max_new_tokens=2)
    assert out.stats.cache_hits == 0 and out.stats.cache_misses == 3   # other keys: nothing to read
    report = admin.verify(store, [engine.fingerprint])
    assert sorted(report.unknown_model) == sorted(other_keys) and not report.corrupt
    assert cli(["store", "verify", "--store", str(tmp_path / "kv"), "--model", "smollm2-135m",
                "--dtype", "float32"]) == 1
    printed = capsys.readouterr().out
    assert "6 entries checked: 0 corrupt, 3 of other models" in printed
    assert all(f"unknown model {k}" in printed for k in other_keys)
    assert cli(["store", "verify", "--store", str(tmp_path / "kv"), "--model", "smollm2-135m", "--dtype",
                "float32", "--delete"]) == 1
    assert sorted(store.keys()) == sorted(k for k in store.keys() if k not in other_keys)
    assert len(store.keys()) == 3 and cli(["store", "verify", "--store", str(tmp_path / "kv")]) == 0


def test_verify_finds_entries_whose_key_does_not_address_their_tokens(tmp_path):
    store = DiskStore(tmp_path / "kv")
    e = store_worker.engine(store)
    good, = e.precompute(CHUNKS[:1])
    entry = store.get(good)
    forged = ChunkKV(chunk_key(e.fingerprint, [1, 2, 3]), entry.token_ids, entry.k, entry.v, entry.meta)
    store.put(forged)
    report = admin.verify(store, [e.fingerprint])
    assert report.corrupt == [(forged.key, "key is not the content address of the entry's tokens")]


def _store_spec(kind: str, tmp_path: Path, request) -> str:
    if kind == "disk":
        return str(tmp_path / "kv")
    url = request.getfixturevalue("redis_url")
    _redis(url).close()                                             # flushed
    return url


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_two_processes_precomputing_the_same_chunks_leave_one_valid_entry_each(tmp_path, request, kind):
    spec = _store_spec(kind, tmp_path, request)
    n = 24
    procs = [subprocess.Popen([sys.executable, str(HERE / "store_worker.py"), spec, str(n)], cwd=HERE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    reader, torn, stop_reading = open_store(spec), [], threading.Event()

    def read_all():                                   # a third process's view: a miss or a whole entry
        while not stop_reading.is_set():
            for key in reader.keys():
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    reader.get(key)
                torn.extend(str(x.message) for x in w)

    t = threading.Thread(target=read_all)
    t.start()
    try:
        for p in procs:
            out, _ = p.communicate(timeout=600)
            assert p.returncode == 0, out.decode()[-3000:]
    finally:
        stop_reading.set()
        t.join()
    assert torn == []
    store = open_store(spec)
    report = admin.verify(store)
    assert report.checked == n and report.ok
    assert len(set(store.keys())) == n


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_a_precompute_killed_halfway_leaves_a_consistent_store_and_the_rerun_computes_only_the_rest(
        tmp_path, request, kind):
    spec = _store_spec(kind, tmp_path, request)
    n = 40
    proc = subprocess.Popen([sys.executable, str(HERE / "store_worker.py"), spec, str(n), "0.05"], cwd=HERE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = open_store(spec)
    deadline = time.time() + 300
    while len(store.keys()) < 8:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = set(store.keys())
    assert 8 <= len(before) < n
    assert admin.verify(store).ok
    if kind == "disk":                                # a temp file may be left behind, never an entry
        assert all(p.suffix == ".safetensors" for p in store.root.rglob("*.safetensors"))
    e = store_worker.engine(store)
    texts = store_worker.chunks(n)
    missing = [t for t in texts if not store.contains(chunk_key(e.fingerprint, _ids(e, t)))]
    assert len(missing) == n - len(before)
    keys = e.precompute(texts)
    assert set(keys) == set(store.keys()) and admin.verify(store).ok


def _ids(engine, text):
    from speccache_rag.prompt import tokenize_piece

    return tokenize_piece(engine.tokenizer, text)[0]


def test_redis_stopped_mid_run_degrades_to_full_prefill_then_reuses_again(smollm2, tmp_path):
    from redis_server import free_port

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")

    port = free_port()
    proc = start_redis(port, tmp_path)
    try:
        store = _redis(f"redis://127.0.0.1:{port}/0", retry_interval=0.2)
        engine = SpecCacheEngine(*smollm2, store=store)
        prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
        engine.precompute(CHUNKS)
        assert engine.generate(prompt, max_new_tokens=2).stats.cache_hits == 3
        full = engine.generate(prompt, max_new_tokens=6, reuse=ReuseConfig(method="full"))
        stop(proc)
        with pytest.warns(UserWarning, match="unreachable"):
            down = engine.generate(prompt, max_new_tokens=6)
        assert down.stats.cache_hits == 0 and down.stats.reused_tokens == 0
        assert down.token_ids == full.token_ids                         # every token recomputed: full prefill
        proc = start_redis(port, tmp_path)                               # empty again (no persistence)
        time.sleep(0.3)
        refill = engine.generate(prompt, max_new_tokens=2)               # misses, stored for the next query
        assert refill.stats.cache_misses == 3 and refill.stats.stored_chunks == 3
        assert engine.generate(prompt, max_new_tokens=2).stats.cache_hits == 3
    finally:
        stop(proc)


@pytest.mark.parametrize("kind", ["memory", "disk", "redis", "tiered"])
@pytest.mark.parametrize("key", ["../../etc/passwd", "ab/cd", "ab\x00cd", "..", "x" * 201, "", "ab cd"])
def test_unsafe_keys_are_rejected_by_every_backend(tmp_path, request, kind, key):
    store = _any_store(kind, tmp_path, request)
    entry = ChunkKV(key, [1], torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    for op in (lambda: store.get(key), lambda: store.contains(key), lambda: store.put(entry),
               lambda: store.delete(key)):
        with pytest.raises(ValueError, match="invalid chunk key"):
            op()


def test_unsafe_metadata_is_rejected_and_huge_headers_are_misses():
    k, v = torch.zeros(1, 1, 1, 2), torch.ones(1, 1, 1, 2)
    for meta in ({"a/b": 1}, {"x\x00": 1}, {"key": "other"}, {"": 1}, {"text": "y" * (17 << 20)}):
        with pytest.raises(ValueError):
            ChunkKV("ab", [1], k, v, meta).to_bytes()
    good = ChunkKV("ab", [1], k, v, {"text": "ok"}).to_bytes()
    assert ChunkKV.from_bytes(good).meta == {"text": "ok"}
    from speccache_rag.kv import CorruptEntry

    for blob in ((1 << 60).to_bytes(8, "little") + good[8:], b"\x00" * 4, (0).to_bytes(8, "little") + good[8:]):
        with pytest.raises(CorruptEntry):
            ChunkKV.from_bytes(blob)


def _any_store(kind: str, tmp_path: Path, request):
    if kind == "memory":
        return MemoryStore()
    if kind == "disk":
        return DiskStore(tmp_path / "kv")
    if kind == "redis":
        return _redis(request.getfixturevalue("redis_url"))
    return TieredStore([MemoryStore(), DiskStore(tmp_path / "kv"), _redis(request.getfixturevalue("redis_url"))])


def test_nothing_in_any_backend_is_unpickled(smollm2, tmp_path, request, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("something tried to unpickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    for kind in ("memory", "disk", "redis", "tiered"):
        store = _any_store(kind, tmp_path / kind, request)
        SpecCacheEngine(*smollm2, store=store).precompute(CHUNKS)
        fresh = SpecCacheEngine(*smollm2, store=store)              # reads what the first one wrote
        assert fresh.generate(prompt, max_new_tokens=1).stats.cache_hits == 3, kind
        assert admin.verify(store).ok and admin.stats(store)["entries"] == 3


def test_two_replicas_share_one_redis(smollm2, redis_url):
    from speccache_rag.matching import prompt_from_text

    a = SpecCacheEngine(*smollm2, store=_redis(redis_url))
    b = SpecCacheEngine(*smollm2, store=open_store(redis_url))
    keys = a.precompute(CHUNKS)
    out = b.generate(RAGPrompt(chunks=CHUNKS, question=QUESTION), max_new_tokens=2)
    assert out.stats.cache_hits == 3 and out.stats.reused_tokens > 0
    # the shared text index: b finds a's chunks inside a framework's prompt text, reading no entry whole
    assert b.store.texts(keys) == dict(zip(keys, CHUNKS))
    b.store.get = lambda key: pytest.fail("texts came from reading whole entries")
    found = prompt_from_text(b, f"Context:\n{CHUNKS[1]}\n\n{CHUNKS[0]}\n\nQuestion: {QUESTION}")
    assert found.chunks == [CHUNKS[1], CHUNKS[0]]
    del b.store.get
    a.store.delete(keys[0])                                         # entry and text go together
    assert keys[0] not in b.store.texts(keys) and b.store.get(keys[0]) is None


def test_tiered_store_fills_faster_tiers_and_counts_per_tier(tmp_path, redis_url):
    redis_tier = _redis(redis_url)
    store = open_store(f"tiered://memory://,{tmp_path / 'kv'},{redis_url}")
    assert [type(t).__name__ for t in store.tiers] == ["MemoryStore", "DiskStore", "RedisStore"]
    e = store_worker.engine(redis_tier)
    key, = e.precompute(CHUNKS[:1])                                 # only in the slowest tier
    assert store.get(key) is not None
    assert [(t["hits"], t["misses"]) for t in store.tier_stats()] == [(0, 1), (0, 1), (1, 0)]
    assert store.tiers[0].contains(key) and store.tiers[1].contains(key)
    assert store.get(key) is not None
    assert store.tier_stats()[0]["hits"] == 1
    store.delete(key)
    assert not any(t.contains(key) for t in store.tiers)


def test_redis_ttl_expires_entries(redis_url):
    _redis(redis_url).close()                                       # an empty database
    store = open_store(redis_url + "?ttl=1")
    assert store.ttl == 1
    store.put(ChunkKV("ttl0", [1], torch.zeros(1, 1, 1, 2), torch.ones(1, 1, 1, 2)))
    store.put(ChunkKV("ttl1", [1], torch.zeros(1, 1, 1, 2), torch.ones(1, 1, 1, 2), {"text": "kept for a second"}))
    assert store.contains("ttl0") and store.texts(["ttl1"]) == {"ttl1": "kept for a second"}
    time.sleep(2.1)
    assert not store.contains("ttl0") and store.keys() == []
    assert store.prune_texts() == 1 and store.texts(["ttl1"]) == {}
    with pytest.raises(ValueError, match="ttl"):
        open_store(redis_url + "?ttl=0")


@pytest.mark.parametrize("kind", ["memory", "disk", "redis"])
def test_store_gc_stats_and_export(tmp_path, request, kind, capsys):
    store = _any_store(kind, tmp_path, request)
    e = store_worker.engine(store)
    keys = e.precompute(store_worker.chunks(6))
    size = len(store.raw(keys[0]))
    if kind == "redis":                                              # Redis's idle clock has 1 s steps
        time.sleep(1.1)
    for key in keys[:3]:                                             # the newest uses: these three
        store.get(key)
        time.sleep(1.1 if kind == "redis" else 0.01)                 # Redis's idle clock has 1 s steps
    freed = admin.gc(store, max_bytes=int(3.5 * size))
    assert freed >= 3 * size * 0.9 and set(store.keys()) <= set(keys)
    left = set(store.keys())
    assert 1 <= len(left) <= 3 and left <= set(keys[:3])
    s = admin.stats(store)                                           # on Redis, reading counts as a use
    assert s["entries"] == len(left) and s["models"][e.fingerprint]["entries"] == len(left)
    dst = tmp_path / "exported"
    copied, skipped = admin.export(store, DiskStore(dst))
    assert copied == len(left) and skipped == 0 and admin.verify(DiskStore(dst), [e.fingerprint]).ok
    if kind == "disk":
        assert cli(["store", "stats", "--store", str(dst)]) == 0
        assert f"{len(left)} entries" in capsys.readouterr().out
        assert cli(["store", "gc", "--store", str(dst), "--max-bytes", "0"]) == 0
        assert DiskStore(dst).keys() == []
        assert cli(["store", "export", "--store", str(dst)]) == 2


# ---- the correctness gate ------------------------------------------------------------------------
def test_the_gate_passes_on_a_real_model_and_is_remembered_in_the_store(smollm2, tmp_path, monkeypatch):
    from speccache_rag import gate

    store = DiskStore(tmp_path / "kv")
    engine = SpecCacheEngine(*smollm2, store=store)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                              # no "serving full prefill only"
        out = engine.generate(RAGPrompt(chunks=CHUNKS, question=QUESTION), max_new_tokens=2)
    assert out.stats.method == "qattn"
    assert store.get_meta(gate.meta_name(engine.fingerprint, "torch"))["failed"] == []
    # the prompt's chunks (misses, stored), and none of the gate's own: it checks in a private store
    assert sorted(store.keys()) == sorted(chunk_key(engine.fingerprint, _ids(engine, c)) for c in CHUNKS)

    def must_not_run(*a, **k):
        raise AssertionError("the gate ran again for a fingerprint the store remembers")

    monkeypatch.setattr(gate, "failing_methods", must_not_run)
    replica = SpecCacheEngine(*smollm2, store=DiskStore(tmp_path / "kv"))
    assert replica.generate(RAGPrompt(chunks=CHUNKS, question=QUESTION), max_new_tokens=1).stats.method == "qattn"


def test_the_first_reuse_request_pays_for_no_gate_and_no_warm_up(smollm2, tmp_path, monkeypatch):
    """A new engine on a fresh store: the gate ran (and its verdict is stored) before any request, and the
    first request's TTFT is that of the ones after it."""
    from speccache_rag import gate

    store = DiskStore(tmp_path / "kv")
    engine = SpecCacheEngine(*smollm2, store=store)
    ls = engine.load_stats
    assert store.get_meta(gate.meta_name(engine.fingerprint, "torch"))["failed"] == []
    assert ls.gate_methods == len(gate.CHECKED) and ls.gate_s > 0 and not ls.gate_from_store
    assert f"{len(gate.CHECKED)} methods ok in" in ls.gate_line()
    engine.precompute(CHUNKS)
    monkeypatch.setattr(gate, "failing_methods", lambda *a: pytest.fail("a request ran the gate"))
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    ttft = [engine.generate(prompt, max_new_tokens=1).stats.ttft_s for _ in range(4)]
    # The gate blends the probe prompt once per method (8 runs): billed to a request it costs it several
    # times its own TTFT. The bound leaves room for a noisy shared machine.
    assert ttft[0] < 2.5 * sorted(ttft[1:])[1] + 0.02, ttft
    replica = SpecCacheEngine(*smollm2, store=DiskStore(tmp_path / "kv"))
    assert replica.load_stats.gate_from_store and "verdict from the store" in replica.load_stats.gate_line()
    assert replica.load_stats.warmup_s > 0                                   # no gate ran: warmed up instead


def test_a_gate_verdict_that_predates_a_method_is_checked_again(smollm2, monkeypatch):
    from speccache_rag import gate

    engine = SpecCacheEngine(*smollm2, store="memory://", gate=False)
    name = gate.meta_name(engine.fingerprint, "torch")
    older = [m for m in gate.CHECKED if m != "deviation"]
    engine.store.put_meta(name, {"failed": [], "checked": older, "model": "smollm2-135m", "backend": "torch"})
    monkeypatch.setattr(gate, "failing_methods", lambda blender, tokenizer: ["deviation"])
    assert gate.run(engine.blender, engine.tokenizer, "torch", "smollm2-135m").failed == ["deviation"]
    assert engine.store.get_meta(name)["checked"] == list(gate.CHECKED)
    monkeypatch.setattr(gate, "failing_methods", lambda blender, tokenizer: pytest.fail("checked twice"))
    assert gate.run(engine.blender, engine.tokenizer, "torch", "smollm2-135m").failed == ["deviation"]


def test_a_method_that_fails_the_gate_makes_the_engine_serve_full_prefill_only(smollm2, monkeypatch):
    from speccache_rag import gate
    from speccache_rag.selection import SELECTORS

    real = SELECTORS["epic"]

    def broken(ops, cache, sel, always):                            # a subtly wrong implementation
        logits, recomputed = real(ops, cache, sel, always)
        return logits + 0.5 * torch.randn_like(logits), recomputed

    monkeypatch.setitem(SELECTORS, "epic", broken)
    with pytest.warns(UserWarning, match="epic do not reproduce full prefill.*serving full prefill only"):
        engine = SpecCacheEngine(*smollm2, store="memory://")                  # the gate runs at build time
    assert engine.load_stats.gate_failed == ["epic"] and "epic failed" in engine.load_stats.gate_line()
    assert gate.failing_methods(engine.blender, engine.tokenizer) == ["epic"]
    prompt = RAGPrompt(chunks=CHUNKS, question=QUESTION)
    full = engine.generate(prompt, max_new_tokens=6, reuse=ReuseConfig(method="full"))
    out = engine.generate(prompt, max_new_tokens=6, reuse=ReuseConfig(method="qattn"))
    assert out.stats.method == "full" and out.stats.reused_tokens == 0 and out.token_ids == full.token_ids
    assert engine.store.get_meta(gate.meta_name(engine.fingerprint, "torch"))["failed"] == ["epic"]
    assert SpecCacheEngine(*smollm2, store="memory://", gate=False).generate(
        prompt, max_new_tokens=1).stats.method == "qattn"
