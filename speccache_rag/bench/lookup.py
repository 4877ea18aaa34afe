"""Benchmark: what a query pays to find chunks by text when the store is large (issue 28).

    python -m speccache_rag.bench.lookup --entries 100000 --store disk:/tmp/kv-lookup
    python -m speccache_rag.bench.lookup --entries 100000 --store redis://127.0.0.1:6379/0

Fills a store with ``--entries`` synthetic entries (tiny tensors, a text each: the lookup never reads the
tensors), then times, per query, the chunk-text index's sync — what a drop-in does before matching a prompt
that came without retrieval hints — with one new entry put between queries: following the store's journal
(``KVStore.added_since``) against listing every key (what the index did before). Ratios from one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tqdm.auto import tqdm

from ..kv import ChunkKV
from ..matching import ChunkTextIndex
from ..store import KVStore, open_store


def entry(i: int) -> ChunkKV:
    k = torch.zeros(1, 1, 2, 4)
    return ChunkKV(f"lk{i:08d}", [i, i + 1], k, k.clone(), meta={"text": f"synthetic chunk {i} " + "x" * 40})


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
    journal = per_query_ms(store, args.queries, args.entries)
    listing = per_query_ms(Listing(store), args.queries, args.entries + args.queries)
    result = {"store": args.store, "entries": args.entries, "queries": args.queries,
              "journal_ms_median": statistics.median(journal), "listing_ms_median": statistics.median(listing)}
    result["listing_over_journal"] = result["listing_ms_median"] / result["journal_ms_median"]
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
