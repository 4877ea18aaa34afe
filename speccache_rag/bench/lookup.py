"""Benchmark: what a query pays to find chunks by text when the store is large (issue 28).

    python -m speccache_rag.bench.lookup --entries 100000 --store disk:/tmp/kv-lookup
    python -m speccache_rag.bench.lookup --entries 100000 --store redis://127.0.0.1:6379/0

Fills a store with ``--entries`` synthetic entries (tiny tensors, a text each: the lookup never reads the
tensors), then times, per query, with one new entry put between queries, following the store's journal
(``KVStore.added_since``) against listing every key (what both indexes did before) for
* the chunk-text index's sync — what a drop-in does before matching a prompt that came without retrieval hints;
* the connector's stored-chunk index (``vllm/lookup.py``): its refresh and the token-content search of one prompt —
  what ``vllm serve`` does for a request without chunk hints.
Ratios from one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm.auto import tqdm

from ..kv import ChunkKV, chunk_key
from ..matching import ChunkTextIndex
from ..store import KVStore, open_store
from ..vllm.lookup import StoredChunkIndex

FINGERPRINT, TOKENS = "lookup-bench", 8


def entry(i: int) -> ChunkKV:
    ids = list(range(i * TOKENS, (i + 1) * TOKENS))
    k = torch.zeros(1, 1, TOKENS, 4)
    return ChunkKV(chunk_key(FINGERPRINT, ids), ids, k, k.clone(),
                   meta={"text": f"synthetic chunk {i} " + "x" * 40, "fingerprint": FINGERPRINT})


class Listing:
    """The store as the index read it before the journal: every key, every time."""

    def __init__(self, store: KVStore):
        self.store = store

    def added_since(self, cursor):
        return self.store.keys(), None

    def texts(self, keys):
        return self.store.texts(keys)


def per_query_ms(store, queries: int, start: int) -> list[float]:
    index = ChunkTextIndex()
    index.sync(store)                                  # the first sync reads the store whole, either way
    times = []
    for q in range(queries):
        (store.store if isinstance(store, Listing) else store).put(entry(start + q))
        t = time.perf_counter()
        assert index.sync(store) == 1
        times.append((time.perf_counter() - t) * 1000)
    return times


def connector_per_query_ms(store: KVStore, queries: int, start: int, listing: bool) -> list[float]:
    index = StoredChunkIndex(store, FINGERPRINT, head=TOKENS)
    index.refresh()
    times = []
    for q in range(queries):
        new = entry(start + q)
        store.put(new)
        t = time.perf_counter()
        index.refresh(full=listing)
        found = index.find([1, 2, 3] + new.token_ids + [4])
        times.append((time.perf_counter() - t) * 1000)
        assert [k for _, _, k in found] == [new.key]
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=100_000)
    p.add_argument("--store", required=True, help="disk:DIR or redis://host:port/db (emptied first)")
    p.add_argument("--queries", type=int, default=20)
    p.add_argument("--json", help="write the result here too")
    args = p.parse_args(argv)
    spec = args.store[len("disk:"):] if args.store.startswith("disk:") else args.store
    store = open_store(spec)
    if spec.startswith("redis://"):
        store._client.flushdb()
    present = len(store.keys())
    for i in tqdm(range(present, args.entries), desc="filling the store", unit="entry"):
        store.put(entry(i))
    n, q = args.entries, args.queries
    result = {"store": args.store, "entries": n, "queries": q}
    for name, journal, listing in (
            ("text_index", lambda: per_query_ms(store, q, n), lambda: per_query_ms(Listing(store), q, n + q)),
            ("connector_index", lambda: connector_per_query_ms(store, q, n + 2 * q, False),
             lambda: connector_per_query_ms(store, q, n + 3 * q, True))):
        follow, relist = statistics.median(journal()), statistics.median(listing())
        result[name] = {"journal_ms_median": follow, "listing_ms_median": relist, "listing_over_journal": relist / follow}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
