"""The connector's Prometheus series on vLLM's ``/metrics``, through vLLM's own KV-connector stats path.

Each worker step, ``SpecCacheStats`` gathers what the blends of that step did (and the scheduler what it refused
or could not use, the worker its gate verdict); vLLM ships it to the frontend
(``KVConnectorOutput.kv_connector_stats``), which hands it to ``SpecCacheProm.observe`` — the same process that
serves ``/metrics``. The torch engine reports the same counts per call in ``GenerationStats``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

# counter name (Prometheus adds _total) → (stats key, help)
COUNTERS = {
    "vllm:speccache_reused_tokens": ("reused_tokens", "Prompt tokens whose KV came from the SpecCache store."),
    "vllm:speccache_recomputed_tokens": ("recomputed_tokens", "Prompt tokens the SpecCache blend recomputed."),
    "vllm:speccache_store_hits": ("hits", "Chunks found in the SpecCache store."),
    "vllm:speccache_store_misses": ("misses", "Chunks the SpecCache store lacked (recomputed, then stored)."),
    "vllm:speccache_blend_errors": ("errors", "Blends that failed (vLLM recomputed the request instead)."),
    "vllm:speccache_ignored_chunks": ("ignored", "Chunk ids a client named that the server could not place."),
    "vllm:speccache_precomputed_chunks": ("stored", "Chunks the SpecCache worker stored."),
    "vllm:speccache_refused_requests": ("refused", "Requests a tenancy policy refused that still reached the engine "
                                                   "(served without reuse; the middleware's HTTP refusals are "
                                                   "vllm:speccache_rejected_requests)."),
    "vllm:speccache_plain_requests": ("plain", "Requests with a SpecCache hint the scheduler could not use (plain "
                                               "vLLM prefill instead)."),
    "vllm:speccache_gate_passed": ("gate_passed", "Workers whose correctness gate passed at start-up."),
    "vllm:speccache_gate_failed": ("gate_failed", "Workers whose correctness gate failed (they serve full prefill)."),
}
# histogram name → (stats key of the observations, help)
HISTOGRAMS = {
    "vllm:speccache_blend_seconds": ("blend_s", "Time of one request's SpecCache blend (load, select, recompute)."),
    "vllm:speccache_store_load_seconds": ("load_s", "Time to read and place one request's chunks from the store."),
}
BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


@dataclass
class SpecCacheStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def record(self, report: dict | None, blend_s: float, ignored: int = 0, failed: bool = False) -> None:
        """One request's blend (``report``: its ``GenerationStats`` as a dict; None when it failed)."""
        self.count("errors", int(failed))
        self.count("ignored", ignored)
        d = self.data
        if report is not None:
            for key, source in (("reused_tokens", "reused_tokens"), ("recomputed_tokens", "recomputed_tokens"),
                                ("hits", "cache_hits"), ("misses", "cache_misses"), ("stored", "stored_chunks")):
                self.count(key, int(report.get(source, 0) or 0))
            d.setdefault("blend_s", []).append(blend_s)
            d.setdefault("load_s", []).append(float(report.get("load_s", 0.0) or 0.0))

    def count(self, key: str, n: int = 1) -> None:
        """An event outside a blend: a scheduler refusal or fallback, a worker's gate verdict."""
        self.data[key] = self.data.get(key, 0) + n

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "SpecCacheStats":
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, [] if isinstance(value, list) else 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: (round(sum(v) / len(v), 4) if v else 0.0) if isinstance(v, list) else v
                for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not self.data


class SpecCacheProm(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {key: create_metric_per_engine(self._counter_cls(name=name, documentation=doc,
                                                                         labelnames=labelnames),
                                                       per_engine_labelvalues)
                         for name, (key, doc) in COUNTERS.items()}
        self.histograms = {key: create_metric_per_engine(self._histogram_cls(name=name, documentation=doc,
                                                                             buckets=BUCKETS, labelnames=labelnames),
                                                         per_engine_labelvalues)
                           for name, (key, doc) in HISTOGRAMS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self.counters.items():
            if transfer_stats_data.get(key):
                metric[engine_idx].inc(transfer_stats_data[key])
        for key, metric in self.histograms.items():
            for value in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(value)
