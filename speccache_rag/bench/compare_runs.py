"""Two bench runs of the same prompts compared prompt by prompt: a lever that lives at ingestion (what the
store holds) cannot be a method of one run, so it is measured as a second run over the same ``--kv-store``.

    python -m speccache_rag.bench.compare_runs bench-results/A bench-results/B --methods qattn@0.15

For each method both runs have, on the prompts both have: first-token KL (mean, share of each run's own
reuse gap closed), wins / losses by KL with the sign test and the permutation test of the mean, and how
often each gave full prefill's own answer (normalized, as ``report_tables`` counts "same answer").
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .metrics import mean
from .report_paired import mean_diff_p, sign_test_p
from .report_tables import normalized_answer
from .results import RESULTS, read_rows


def quality_rows(run: Path) -> dict[tuple[str, str], dict]:
    """``{(method, example): row}`` of a run's quality rows."""
    return {(r["method"], str(r["example"])): r for r in read_rows(run / RESULTS) if r.get("kind") == "quality"}


def compare(a: dict[tuple[str, str], dict], b: dict[tuple[str, str], dict], method: str) -> dict | None:
    """``method`` in run a against run b on the prompts both have (with full and reuse in both), or None."""
    examples = sorted({e for m, e in a if m == method} & {e for m, e in b if m == method}
                      & {e for m, e in a if m == "full"} & {e for m, e in b if m == "full"})
    if not examples:
        return None
    out: dict = {"method": method, "prompts": len(examples)}
    for name, run in (("a", a), ("b", b)):
        kl = mean([run[method, e]["kl"] for e in examples])
        reuse = [run["reuse", e]["kl"] for e in examples if ("reuse", e) in run]
        out[f"kl_{name}"] = kl
        out[f"closed_{name}"] = 1 - kl / mean(reuse) if len(reuse) == len(examples) and mean(reuse) else None
        out[f"same_answer_{name}"] = sum(normalized_answer(run[method, e]) == normalized_answer(run["full", e])
                                         for e in examples)
    diffs = [b[method, e]["kl"] - a[method, e]["kl"] for e in examples]        # positive: a is closer to full
    out["wins_a"], out["losses_a"] = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    out["sign_p"], out["mean_p"] = sign_test_p(out["wins_a"], out["losses_a"]), mean_diff_p(diffs)
    return out


def table(results: list[dict], label_a: str, label_b: str) -> list[str]:
    def pct(x):
        return "–" if x is None else f"{100 * x:.1f} %"
    lines = [f"| method | prompts | KL {label_a} | KL {label_b} | gap closed {label_a} | gap closed {label_b} | "
             f"KL W/L {label_a} vs {label_b} (sign p, mean p) | full's answer {label_a} | full's answer {label_b} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        n = r["prompts"]
        lines.append(f"| {r['method']} | {n} | {r['kl_a']:.4f} | {r['kl_b']:.4f} | {pct(r['closed_a'])} | "
                     f"{pct(r['closed_b'])} | {r['wins_a']}/{r['losses_a']} ({r['sign_p']:.3g}, {r['mean_p']:.3g}) | "
                     f"{r['same_answer_a']}/{n} | {r['same_answer_b']}/{n} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m speccache_rag.bench.compare_runs", description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="a results directory (the lever)")
    ap.add_argument("b", type=Path, help="a results directory of the same prompts (without it)")
    ap.add_argument("--methods", default="", help="comma-separated methods (default: every one both runs have)")
    args = ap.parse_args(argv)
    a, b = quality_rows(args.a), quality_rows(args.b)
    if not a or not b:
        ap.error(f"no quality rows in {args.a if not a else args.b}/{RESULTS}")
    methods = ([m for m in args.methods.split(",") if m] or
               sorted({m for m, _ in a} & {m for m, _ in b} - {"full", "reuse"}))
    results = [r for r in (compare(a, b, m) for m in methods) if r]
    if not results:
        ap.error("the two runs share no prompt of these methods (with full prefill in both)")
    print("\n".join(table(results, args.a.name, args.b.name)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
