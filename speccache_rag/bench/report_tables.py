"""The report's tables: each method's means over the prompts every listed method has, and the markdown
tables built from them."""
from __future__ import annotations

import math
from collections import defaultdict

from .methods import parse_method
from .metrics import geomean, mean, normalize_answer


def fmt(x, nd: int = 3, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, str):          # a nominal ratio of "auto"
        return x
    if pct:
        return f"{100 * x:.1f} %"
    return f"{x:.{nd}f}"


def _by_method(rows: list[dict], methods: list[str]) -> tuple[dict[str, list[dict]], list[str]]:
    """Rows of each method restricted to the examples every listed method has (a fair comparison)."""
    per: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        per[r["method"]][r["example"]] = r
    present = [m for m in methods if per.get(m)]
    common = set.intersection(*(set(per[m]) for m in present)) if present else set()
    return {m: [per[m][e] for e in sorted(common)] for m in present}, sorted(common)


def summarize(rows: list[dict], methods: list[str]) -> tuple[dict[str, dict], int]:
    by, common = _by_method(rows, methods)
    # full's own answer, normalized as the task scores are: "same answer" forgives a different spelling of
    # it (case, articles, punctuation, what follows the first line), "same cont." does not
    full_answer = {r["example"]: normalized_answer(r) for r in by.get("full", [])}
    out = {}
    for m, rs in by.items():
        out[m] = {k: mean([r.get(k) for r in rs]) for k in ("score", "f1", "em", "rougeL", "match", "kl", "top1",
                                                            "cont_rougeL", "recompute_frac")}
        out[m]["same_continuation"] = mean([float(r.get("same_continuation", False)) for r in rs])
        out[m]["same_answer"] = (mean([float(normalized_answer(r) == full_answer[r["example"]]) for r in rs])
                                 if full_answer and all("prediction" in r for r in rs) else None)
        out[m]["per_task"] = defaultdict(list)
        for r in rs:
            out[m]["per_task"][r["task"]].append(r["score"])
        out[m]["per_task"] = {t: mean(v) for t, v in out[m]["per_task"].items()}
    return out, len(common)


def normalized_answer(row: dict) -> str | None:
    """A quality row's answer as the task scores normalize it, first line only (None: no prediction kept)."""
    return normalize_answer(row["prediction"].strip().split("\n")[0]) if "prediction" in row else None


def ttft_summary(rows: list[dict]) -> dict[str, dict]:
    per: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        per[r["method"]].append(r)
    out = {}
    for m, rs in per.items():
        out[m] = {
            "ratio": geomean([r["ratio_to_full"] for r in rs]),
            "ttft_s": mean([r["ttft_median_s"] for r in rs]),
            "prompts": len(rs),
            "reps": min(len(r["ttft_s"]) for r in rs),
            "min_s": min(min(r["ttft_s"]) for r in rs), "max_s": max(max(r["ttft_s"]) for r in rs),
            "prompt_tokens": mean([r["prompt_tokens"] for r in rs]),
            **{k: mean([r["breakdown"][k] for r in rs]) for k in ("load_s", "draft_s", "recompute_s", "first_decode_s")},
        }
    return out


def relative(summary: dict, m: str) -> tuple[float | None, float | None, float | None]:
    """Method m against the bounds: (share of full's task score, normalized score (S − S_reuse) / (S_full −
    S_reuse) — 0 = naive reuse, 1 = full prefill —, share of reuse's first-token KL gap closed)."""
    s, full, reuse = summary[m], summary.get("full"), summary.get("reuse")
    kept = s["score"] / full["score"] if full and full["score"] else None
    normalized = ((s["score"] - reuse["score"]) / (full["score"] - reuse["score"])
                  if full and reuse and full["score"] != reuse["score"] else None)
    closed = 1 - s["kl"] / reuse["kl"] if reuse and reuse["kl"] else None
    return kept, normalized, closed


def headline_table(summary: dict, ttft: dict, methods: list[str]) -> list[str]:
    lines = ["| method | recomputed | task score | % of full | normalized | F1 | KL(full ‖ m) | KL gap closed "
             "| top-1 agree | cont. ROUGE-L | same cont. | same answer | TTFT / full | speedup |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in methods:
        if m not in summary:
            continue
        s, t = summary[m], ttft.get(m, {})
        ratio = t.get("ratio")
        kept, normalized, closed = relative(summary, m)
        lines.append(f"| {m} | {fmt(s['recompute_frac'], pct=True)} | {fmt(s['score'])} | {fmt(kept, pct=True)} | "
                     f"{fmt(normalized, 2)} | {fmt(s['f1'])} | "
                     f"{fmt(s['kl'], 4)} | {fmt(closed, pct=True)} | {fmt(s['top1'], 2)} | {fmt(s['cont_rougeL'])} | "
                     f"{fmt(s['same_continuation'], 2)} | {fmt(s['same_answer'], 2)} | {fmt(ratio)} | "
                     f"{fmt(1 / ratio, 2) + '×' if ratio else '–'} |")
    return lines


def task_table(summary: dict, methods: list[str]) -> list[str]:
    tasks = sorted({t for s in summary.values() for t in s["per_task"]})
    lines = ["| method | " + " | ".join(tasks) + " | mean |", "|---|" + "---:|" * (len(tasks) + 1)]
    for m in methods:
        if m in summary:
            s = summary[m]
            lines.append(f"| {m} | " + " | ".join(fmt(s["per_task"].get(t)) for t in tasks) + f" | {fmt(s['score'])} |")
    return lines


def ttft_table(ttft: dict, methods: list[str]) -> list[str]:
    lines = ["| method | TTFT (s) | range (s) | TTFT / full | load (s) | draft / select (s) | recompute (s) "
             "| first decode (s) | prompts × reps | prompt tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in methods:
        if m in ttft:
            t = ttft[m]
            lines.append(f"| {m} | {fmt(t['ttft_s'])} | {t['min_s']:.2f}–{t['max_s']:.2f} | {fmt(t['ratio'])} | "
                         f"{fmt(t['load_s'])} | {fmt(t['draft_s'])} "
                         f"| {fmt(t['recompute_s'])} | {fmt(t['first_decode_s'], 4)} | {t['prompts']} × {t['reps']} "
                         f"| {t['prompt_tokens']:.0f} |")
    return lines


def sweep_table(summary: dict, methods: list[str]) -> list[str]:
    lines = ["| method | r (nominal) | recomputed | task score | KL | top-1 | cont. ROUGE-L |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for m in methods:
        if m in summary:
            s, spec = summary[m], parse_method(m)
            lines.append(f"| {m} | {fmt(spec.ratio, 2)} | {fmt(s['recompute_frac'], pct=True)} | {fmt(s['score'])} | "
                         f"{fmt(s['kl'], 4)} | {fmt(s['top1'], 2)} | {fmt(s['cont_rougeL'])} |")
    return lines


AGREE_KEYS = [("jaccard_draft_vs_target_deep", "draft deep vs target deep"),
              ("jaccard_target_l0_vs_deep", "target layer 0 vs target deep"),
              ("jaccard_random_vs_target_deep", "random vs target deep"),
              ("jaccard_expected_random", "expected for random sets")]


def agreement_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["| Jaccard of top-20 % chunk tokens | mean | min | max |", "|---|---:|---:|---:|"]
    for k, label in AGREE_KEYS:
        v = [r[k] for r in rows]
        lines.append(f"| {label} | {fmt(mean(v))} | {fmt(min(v))} | {fmt(max(v))} |")
    lines += ["", f"Shape of the target's deep-layer norm over chunk tokens ({len(rows)} prompts): p90/p10 = "
              f"{fmt(mean([r['target_deep_norm_p90_over_p10'] for r in rows]), 2)}, max/median = "
              f"{fmt(mean([r['target_deep_norm_max_over_median'] for r in rows]), 2)}, prompt's first token/median = "
              f"{fmt(mean([r['prompt_first_token_over_median'] for r in rows]), 1)}; share of the top 20 % that are "
              f"among a chunk's first 4 tokens: {fmt(mean([r['top_chunk_initial_share'] for r in rows]), pct=True)}."]
    tops: dict[str, int] = defaultdict(int)
    for r in rows:
        for tok, n in r.get("top_tokens", []):
            tops[tok] += n
    if tops:
        common = sorted(tops.items(), key=lambda kv: -kv[1])[:15]
        lines.append("Most frequent tokens in the target's top 20 %: " + ", ".join(f"`{t}` ({n})" for t, n in common) + ".")
    return lines


ORDER = ("full", "reuse", "epic-k16", "cacheblend@0.15", "random@0.15", "qattn@0.15", "speccache@0.15", "norm@0.15")


def tabulated_methods(suite_methods: list[str], rows: list[dict]) -> tuple[list[str], list[str]]:
    """The methods to tabulate: the suite's, and any other that a run of this directory (``--methods``, resumed
    in parts) gave every prompt full has; sweep-only methods (a few prompts) stay in the sweep table.

    → (headline methods, partial ones): a suite method on fewer than half of full's prompts (added to a
    suite after part of it ran) would shrink the headline to its prompts, so it gets a table of its own."""
    examples: dict[str, set] = defaultdict(set)
    for r in rows:
        examples[r["method"]].add(r["example"])
    full = examples.get("full", set())
    present = sorted((m for m in examples if m in suite_methods or (full and examples[m] >= full)),
                     key=lambda m: (ORDER.index(m) if m in ORDER else len(ORDER), m))
    partial = [m for m in present if 2 * len(examples[m]) < len(full)]
    return [m for m in present if m not in partial], partial


def target_table(rows: list[dict], target: str, drafts: list[str], suite: dict) -> list[str]:
    """One table for a target scored by several drafts: draft-independent methods once, then each
    draft method per draft, on the prompts they all have, with TTFT ratios from the same rounds."""
    def label(r: dict) -> str:
        return r["method"] if r.get("draft") is None else f"{r['method']} ← {r['draft']}"

    present, _ = tabulated_methods(suite["methods"], [r for r in rows if r["kind"] == "quality" and r["target"] == target])
    methods = [m for m in present if not parse_method(m).uses_draft]
    methods += [f"{m} ← {d}" for m in present if parse_method(m).uses_draft for d in drafts]
    relabel = lambda kind: [{**r, "method": label(r)} for r in rows if r["kind"] == kind and r["target"] == target
                            and r.get("draft") in (*drafts, None)]
    summary, n = summarize(relabel("quality"), methods)
    if not summary:
        return []
    ttft = ttft_summary(relabel("ttft"))
    tasks = sorted({t for v in summary.values() for t in v["per_task"]})
    lines = [f"### All drafts of `{target}` ({n} prompts)", "",
             "| method | recomputed | task score | " + " | ".join(tasks) + " | KL(full ‖ m) | KL gap closed | top-1 agree "
             "| TTFT / full | speedup |", "|---|" + "---:|" * (len(tasks) + 7)]
    for m in methods:
        if m in summary:
            q, ratio = summary[m], ttft.get(m, {}).get("ratio")
            lines.append(f"| {m} | {fmt(q['recompute_frac'], pct=True)} | {fmt(q['score'])} | "
                         + " | ".join(fmt(q["per_task"].get(t)) for t in tasks)
                         + f" | {fmt(q['kl'], 4)} | {fmt(relative(summary, m)[2], pct=True)} | "
                         f"{fmt(q['top1'], 2)} | {fmt(ratio)} | {fmt(1 / ratio, 2) + '×' if ratio else '–'} |")
    return lines + [""]
