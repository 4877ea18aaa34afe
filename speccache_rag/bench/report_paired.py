"""The report's paired comparisons: methods compared prompt by prompt (sign test, permutation test of the
mean) against the baselines, and the quality issue's goals."""
from __future__ import annotations

import math
from collections import defaultdict

from .metrics import mean
from .report_tables import fmt, relative
from .suites import DEFAULT


def sign_test_p(wins: int, losses: int) -> float:
    """Two-sided exact sign test: how likely a split at least this uneven is under a fair coin (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2 ** n)


def paired_diffs(rows: list[dict], a: str, b: str, key: str, lower_is_better: bool = False) -> list[float]:
    """Per prompt both methods have, how much better a is than b by ``key`` (positive: a is better)."""
    per: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        per[r["method"]][r["example"]] = r[key]
    sign = -1 if lower_is_better else 1
    return [sign * (per[a][e] - per[b][e]) for e in sorted(set(per.get(a, {})) & set(per.get(b, {})))]


def paired(rows: list[dict], a: str, b: str, key: str, lower_is_better: bool = False) -> tuple[int, int, int]:
    """(prompts where method a beats b by ``key``, where it loses, prompts both have)."""
    diffs = paired_diffs(rows, a, b, key, lower_is_better)
    return sum(d > 0 for d in diffs), sum(d < 0 for d in diffs), len(diffs)


def mean_diff_p(diffs: list[float], resamples: int = 20000, seed: int = 0) -> float:
    """Two-sided paired permutation test of a zero mean difference: how often flipping the sign of each
    prompt's difference at random gives a mean at least as far from zero (the sign test ignores how much a
    prompt differs; task scores of 0, 1/3, 2/3, 1 tie often, so this is the test "on the mean")."""
    import numpy as np

    d = np.asarray(diffs, dtype=float)
    if d.size == 0 or not d.any():
        return 1.0
    signs = np.random.default_rng(seed).choice((-1.0, 1.0), size=(resamples, d.size))
    extreme = np.abs(signs @ d) >= abs(d.sum()) - 1e-12
    return float((extreme.sum() + 1) / (resamples + 1))


BASELINES = ("cacheblend@0.15", "epic-k16", "norm@0.15", "full")


def paired_table(rows: list[dict], methods: list[str]) -> list[str]:
    """Every method against each baseline, prompt by prompt: wins / losses on task score and on first-token KL,
    with the sign test's p."""
    baselines = [b for b in BASELINES if any(r["method"] == b for r in rows)]
    lines = ["| method | " + " | ".join(f"vs {b}: score W/L (p) | KL W/L (p)" for b in baselines) + " |",
             "|---|" + "---:|---:|" * len(baselines)]
    for m in methods:
        if m in ("full", "reuse") or not any(r["method"] == m for r in rows):
            continue
        cells = []
        for b in baselines:
            if b == m:
                cells += ["–", "–"]
                continue
            (w, l, _), (wk, lk, _) = paired(rows, m, b, "score"), paired(rows, m, b, "kl", lower_is_better=True)
            cells += [f"{w}/{l} ({sign_test_p(w, l):.3g})", f"{wk}/{lk} ({sign_test_p(wk, lk):.3g})"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def goal_lines(summary: dict, rows: list[dict]) -> list[str]:
    """The quality issue's goals, for the default (``ReuseConfig()``, by its bench name) and for speccache, at
    r = 0.15."""
    full, reuse = summary.get("full"), summary.get("reuse")
    if not full or not reuse:
        return []
    out = []
    for m, kl_goal in ((DEFAULT, 0.80), ("speccache@0.15", 0.70)):
        s = summary.get(m)
        if not s:
            continue
        keep, norm, closed = relative(summary, m)
        out.append(f"- {m}: keeps {fmt(keep, pct=True)} of full's task score, normalized score {fmt(norm, 2)}, "
                   f"closes {fmt(closed, pct=True)} of reuse's KL gap (goal ≥ {kl_goal:.0%}).")
        for b in ("cacheblend@0.15", "epic-k16"):
            if b in summary:
                tasks = sorted(s["per_task"])
                better = [t for t in tasks if s["per_task"][t] > summary[b]["per_task"].get(t, float("nan"))]
                w, l, n = paired(rows, m, b, "score")
                p_mean = mean_diff_p(paired_diffs(rows, m, b, "score"))
                out.append(f"  - vs {b}: better on {len(better)}/{len(tasks)} tasks ({', '.join(better) or 'none'}); "
                           f"mean {fmt(s['score'])} vs {fmt(summary[b]['score'])}; paired over {n} prompts "
                           f"{w} wins / {l} losses, sign test p = {sign_test_p(w, l):.3g}, paired permutation "
                           f"test of the mean p = {p_mean:.3g}; per task: "
                           + "; ".join(_task_pair([r for r in rows if r["task"] == t], m, b, t) for t in tasks)
                           + ".")
    return out


def _task_pair(rows: list[dict], m: str, b: str, task: str) -> str:
    """One task's paired comparison on the prompts both methods have: mean scores, wins / losses, the
    permutation test of the mean, and how often each gave full's own answer (a task full itself often
    gets wrong cannot be won by reproducing full)."""
    per = {k: {r["example"]: r for r in rows if r["method"] == k} for k in (m, b)}
    both = sorted(set(per[m]) & set(per[b]))
    score = {k: fmt(mean([per[k][e]["score"] for e in both])) for k in (m, b)}
    same = {k: sum(bool(per[k][e].get("same_continuation")) for e in both) for k in (m, b)}
    w, l, _ = paired(rows, m, b, "score")
    return (f"{task} {score[m]} vs {score[b]}, {w}/{l}, mean p = {mean_diff_p(paired_diffs(rows, m, b, 'score')):.3g}, "
            f"full's answer {same[m]}/{len(both)} vs {same[b]}/{len(both)}")
