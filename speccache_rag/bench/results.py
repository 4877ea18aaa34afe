"""The results directory a bench run writes: ``results.jsonl`` (one JSON row per result) and ``suite.json``."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = "results.jsonl"
SUITE_FILE = "suite.json"


def row_key(row: dict) -> tuple:
    return (row["kind"], row["target"], row.get("draft"), row["example"], row.get("method"))


def read_rows(path: Path) -> list[dict]:
    """Rows of a results file; a torn last line (interrupted write) is ignored. Later rows win."""
    rows: dict[tuple, dict] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[row_key(row)] = row
    return list(rows.values())
