"""A precompute process for the fault suite: ``python store_worker.py STORE N [DELAY]``.

Precomputes N synthetic chunks with a deterministic random-weight model (every process computes the
same keys), pausing DELAY seconds between chunks so that a test can kill it halfway."""
import sys
import time

from speccache_rag import SpecCacheEngine

from tiny_models import tiny_random_model


def chunks(n: int) -> list[str]:
    return [f"Chunk {i}: the ledger of depot {i} records {i * 13 % 97} crates and {i * 7 % 31} barrels."
            for i in range(n)]


def engine(store) -> SpecCacheEngine:
    model, tok = tiny_random_model("llama", seed=7)
    return SpecCacheEngine(model, tok, store=store)


if __name__ == "__main__":
    store, n = sys.argv[1], int(sys.argv[2])
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    e = engine(store)
    for text in chunks(n):
        e.precompute([text])
        time.sleep(delay)
    print("done", flush=True)
