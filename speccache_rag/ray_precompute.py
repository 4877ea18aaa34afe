"""Distributed precompute on Ray Data: ``speccache-rag precompute DOCS --store redis://… --ray``.

Chunk texts become a Ray dataset; ``map_batches`` runs them through a pool of actors, each holding one
engine (one model load per actor, not per batch). An actor skips a chunk whose key its store already
holds and writes new ones by content key, so the job is idempotent: a rerun after a crash (or a second
job over overlapping documents) computes only what is missing. Every actor opens the store from its
spec: it must be one that all of them reach (a directory on shared storage, or Redis).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

STATUSES = ("new", "skipped", "failed")


def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError("--ray needs the 'ray' extra: pip install 'speccache-rag[ray]'") from e
    return ray


@dataclass
class PrecomputeSummary:
    chunks: int
    new: int
    skipped: int
    failed: int
    seconds: float
    actors: int

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.seconds if self.seconds else 0.0

    def line(self) -> str:
        return (f"{self.chunks} chunks: {self.new} new, {self.skipped} already stored, {self.failed} failed "
                f"({self.seconds:.1f}s, {self.chunks_per_s:.2f} chunks/s on {self.actors} actor(s))")


class ChunkKVWorker:
    """A Ray Data callable class: one engine per actor, a batch of chunk texts per call."""

    def __init__(self, target: str, store: str, dtype: str = "auto", threads: int = 1):
        from .engine import SpecCacheEngine

        # precompute only: no request is served here, so neither the gate nor a warm-up is needed
        self.engine = SpecCacheEngine.from_pretrained(target, store=store, dtype=dtype, threads=threads,
                                                      gate=False, warm_up=False)

    def __call__(self, batch: dict) -> dict:
        from .prompt import tokenize_piece

        e = self.engine
        keys, statuses, errors = [], [], []
        for text in batch["text"]:
            key, status, error = "", "failed", ""
            try:
                key, new = e.blender.ensure_stored(tokenize_piece(e.tokenizer, str(text))[0], str(text))
                status = "new" if new else "skipped"
            except Exception as exc:  # one bad chunk must not sink the job: it is counted and reported
                error = f"{type(exc).__name__}: {exc}"
            keys.append(key)
            statuses.append(status)
            errors.append(error)
        return {"key": keys, "status": statuses, "error": errors}


def ray_precompute(texts: list[str], target: str, store: str, dtype: str = "auto", actors: int | None = None,
                   batch_size: int = 4, address: str | None = None) -> PrecomputeSummary:
    """Precompute ``texts`` on a Ray cluster (``address``; None starts a local one for this call)."""
    if not isinstance(store, str) or store.startswith("memory://"):
        raise ValueError("--ray needs a store every worker reaches: a shared directory or redis://…, not memory://")
    if not texts:
        raise ValueError("nothing to precompute")
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
    try:
        actors = actors or max(1, int(ray.available_resources().get("CPU", 1)))
        t = time.perf_counter()
        ds = ray.data.from_items([{"text": text} for text in texts])
        out = ds.map_batches(ChunkKVWorker, fn_constructor_kwargs={"target": target, "store": store, "dtype": dtype},
                             batch_size=batch_size, concurrency=actors, num_cpus=1)
        rows = out.take_all()
        seconds = time.perf_counter() - t
    finally:
        if started:
            ray.shutdown()
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    failures = [r["error"] for r in rows if r["status"] == "failed"]
    if failures:
        import warnings

        warnings.warn(f"{len(failures)} chunk(s) failed; first: {failures[0]}", stacklevel=2)
    return PrecomputeSummary(len(rows), counts["new"], counts["skipped"], counts["failed"], seconds, actors)
