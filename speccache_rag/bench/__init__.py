"""``speccache-rag bench``: quality × time-to-first-token benchmarks.

    speccache-rag bench --suite quick|core|paper [--out DIR] [--resume | --fresh]

Writes ``DIR/results.jsonl`` (one row per example × method, resumable), ``DIR/report.md`` and PNG
plots. See docs/benchmarks.md. Library use::

    from speccache_rag.bench import get_suite, run_suite
    run_suite(get_suite("quick").replace(n_per_task=1), "bench-out", fresh=True)
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Example": "data", "synthetic": "data", "make_example": "data", "load_longbench": "data",
    "normalize_answer": "metrics", "f1_score": "metrics", "exact_match": "metrics", "rouge_l": "metrics",
    "task_scores": "metrics", "first_token_fidelity": "metrics",
    "write_report": "report", "run_suite": "suite_run",
    "SUITES": "suites", "Suite": "suites", "get_suite": "suites",
    "add_arguments": "cli", "main": "cli", "run_from_args": "cli",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # lazy: ``speccache-rag --help`` must not import torch
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
