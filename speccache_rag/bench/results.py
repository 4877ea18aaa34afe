"""The results directory a bench run writes: ``results.jsonl`` (one JSON row per result) and ``suite.json``."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = "results.jsonl"
SUITE_FILE = "suite.json"


def row_key(row: dict) -> tuple:
    return (row["kind"], row["target"], row.get("draft"), row["example"], row.get("method"))


def read_rows(path: Path, key=row_key) -> list[dict]:
    """Rows of a results file; a torn last line (interrupted write) is ignored. Of rows with the same ``key``
    the later wins; ``key=None`` keeps every row."""
    rows: dict = {}
    if path.exists():
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[key(row) if key else i] = row
    return list(rows.values())
