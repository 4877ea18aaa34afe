"""Markdown tables and PNG plots from a results directory (``results.jsonl`` + ``suite.json``)."""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

from .data import PROSE_SOURCE
from .methods import parse_method
from .metrics import geomean, mean
from .results import RESULTS, SUITE_FILE, read_rows

REPORT = "report.md"


def _fmt(x, nd: int = 3, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, str):          # a nominal ratio of "auto"
        return x
    if pct:
        return f"{100 * x:.1f} %"
    return f"{x:.{nd}f}"


def _slug(*parts: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", "_".join(parts).lower()).strip("-")


def _pair_rows(rows: list[dict], kind: str, target: str, draft: str) -> list[dict]:
    return [r for r in rows if r["kind"] == kind and r["target"] == target and r.get("draft") in (draft, None)]


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
    out = {}
    for m, rs in by.items():
        out[m] = {k: mean([r.get(k) for r in rs]) for k in ("score", "f1", "em", "rougeL", "match", "kl", "top1",
                                                            "cont_rougeL", "recompute_frac")}
        out[m]["same_continuation"] = mean([float(r.get("same_continuation", False)) for r in rs])
        out[m]["per_task"] = defaultdict(list)
        for r in rs:
            out[m]["per_task"][r["task"]].append(r["score"])
        out[m]["per_task"] = {t: mean(v) for t, v in out[m]["per_task"].items()}
    return out, len(common)


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


def _relative(summary: dict, m: str) -> tuple[float | None, float | None, float | None]:
    """Method m against the bounds: (share of full's task score, normalized score (S − S_reuse) / (S_full −
    S_reuse) — 0 = naive reuse, 1 = full prefill —, share of reuse's first-token KL gap closed)."""
    s, full, reuse = summary[m], summary.get("full"), summary.get("reuse")
    kept = s["score"] / full["score"] if full and full["score"] else None
    normalized = ((s["score"] - reuse["score"]) / (full["score"] - reuse["score"])
                  if full and reuse and full["score"] != reuse["score"] else None)
    closed = 1 - s["kl"] / reuse["kl"] if reuse and reuse["kl"] else None
    return kept, normalized, closed


def _headline_table(summary: dict, ttft: dict, methods: list[str]) -> list[str]:
    lines = ["| method | recomputed | task score | % of full | normalized | F1 | KL(full ‖ m) | KL gap closed "
             "| top-1 agree | cont. ROUGE-L | same cont. | TTFT / full | speedup |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in methods:
        if m not in summary:
            continue
        s, t = summary[m], ttft.get(m, {})
        ratio = t.get("ratio")
        kept, normalized, closed = _relative(summary, m)
        lines.append(f"| {m} | {_fmt(s['recompute_frac'], pct=True)} | {_fmt(s['score'])} | {_fmt(kept, pct=True)} | "
                     f"{_fmt(normalized, 2)} | {_fmt(s['f1'])} | "
                     f"{_fmt(s['kl'], 4)} | {_fmt(closed, pct=True)} | {_fmt(s['top1'], 2)} | {_fmt(s['cont_rougeL'])} | "
                     f"{_fmt(s['same_continuation'], 2)} | {_fmt(ratio)} | "
                     f"{_fmt(1 / ratio, 2) + '×' if ratio else '–'} |")
    return lines


def _task_table(summary: dict, methods: list[str]) -> list[str]:
    tasks = sorted({t for s in summary.values() for t in s["per_task"]})
    lines = ["| method | " + " | ".join(tasks) + " | mean |", "|---|" + "---:|" * (len(tasks) + 1)]
    for m in methods:
        if m in summary:
            s = summary[m]
            lines.append(f"| {m} | " + " | ".join(_fmt(s["per_task"].get(t)) for t in tasks) + f" | {_fmt(s['score'])} |")
    return lines


def _ttft_table(ttft: dict, methods: list[str]) -> list[str]:
    lines = ["| method | TTFT (s) | range (s) | TTFT / full | load (s) | draft / select (s) | recompute (s) "
             "| first decode (s) | prompts × reps | prompt tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in methods:
        if m in ttft:
            t = ttft[m]
            lines.append(f"| {m} | {_fmt(t['ttft_s'])} | {t['min_s']:.2f}–{t['max_s']:.2f} | {_fmt(t['ratio'])} | "
                         f"{_fmt(t['load_s'])} | {_fmt(t['draft_s'])} "
                         f"| {_fmt(t['recompute_s'])} | {_fmt(t['first_decode_s'], 4)} | {t['prompts']} × {t['reps']} "
                         f"| {t['prompt_tokens']:.0f} |")
    return lines


def _sweep_table(summary: dict, methods: list[str]) -> list[str]:
    lines = ["| method | r (nominal) | recomputed | task score | KL | top-1 | cont. ROUGE-L |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for m in methods:
        if m in summary:
            s, spec = summary[m], parse_method(m)
            lines.append(f"| {m} | {_fmt(spec.ratio, 2)} | {_fmt(s['recompute_frac'], pct=True)} | {_fmt(s['score'])} | "
                         f"{_fmt(s['kl'], 4)} | {_fmt(s['top1'], 2)} | {_fmt(s['cont_rougeL'])} |")
    return lines


AGREE_KEYS = [("jaccard_draft_vs_target_deep", "draft deep vs target deep"),
              ("jaccard_target_l0_vs_deep", "target layer 0 vs target deep"),
              ("jaccard_random_vs_target_deep", "random vs target deep"),
              ("jaccard_expected_random", "expected for random sets")]


def _agreement_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["| Jaccard of top-20 % chunk tokens | mean | min | max |", "|---|---:|---:|---:|"]
    for k, label in AGREE_KEYS:
        v = [r[k] for r in rows]
        lines.append(f"| {label} | {_fmt(mean(v))} | {_fmt(min(v))} | {_fmt(max(v))} |")
    lines += ["", f"Shape of the target's deep-layer norm over chunk tokens ({len(rows)} prompts): p90/p10 = "
              f"{_fmt(mean([r['target_deep_norm_p90_over_p10'] for r in rows]), 2)}, max/median = "
              f"{_fmt(mean([r['target_deep_norm_max_over_median'] for r in rows]), 2)}, prompt's first token/median = "
              f"{_fmt(mean([r['prompt_first_token_over_median'] for r in rows]), 1)}; share of the top 20 % that are "
              f"among a chunk's first 4 tokens: {_fmt(mean([r['top_chunk_initial_share'] for r in rows]), pct=True)}."]
    tops: dict[str, int] = defaultdict(int)
    for r in rows:
        for tok, n in r.get("top_tokens", []):
            tops[tok] += n
    if tops:
        common = sorted(tops.items(), key=lambda kv: -kv[1])[:15]
        lines.append("Most frequent tokens in the target's top 20 %: " + ", ".join(f"`{t}` ({n})" for t, n in common) + ".")
    return lines


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


def _paired_table(rows: list[dict], methods: list[str]) -> list[str]:
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


def _goals(summary: dict, rows: list[dict]) -> list[str]:
    """The quality issue's goals, for the default method (``ReuseConfig()``) and for speccache, at r = 0.15."""
    from ..config import ReuseConfig

    full, reuse = summary.get("full"), summary.get("reuse")
    if not full or not reuse:
        return []
    out = []
    for m, kl_goal in ((f"{ReuseConfig().method}@0.15", 0.80), ("speccache@0.15", 0.70)):
        s = summary.get(m)
        if not s:
            continue
        keep, norm, closed = _relative(summary, m)
        out.append(f"- {m}: keeps {_fmt(keep, pct=True)} of full's task score, normalized score {_fmt(norm, 2)}, "
                   f"closes {_fmt(closed, pct=True)} of reuse's KL gap (goal ≥ {kl_goal:.0%}).")
        for b in ("cacheblend@0.15", "epic-k16"):
            if b in summary:
                tasks = sorted(s["per_task"])
                better = [t for t in tasks if s["per_task"][t] > summary[b]["per_task"].get(t, float("nan"))]
                w, l, n = paired(rows, m, b, "score")
                p_mean = mean_diff_p(paired_diffs(rows, m, b, "score"))
                out.append(f"  - vs {b}: better on {len(better)}/{len(tasks)} tasks ({', '.join(better) or 'none'}); "
                           f"mean {_fmt(s['score'])} vs {_fmt(summary[b]['score'])}; paired over {n} prompts "
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
    score = {k: _fmt(mean([per[k][e]["score"] for e in both])) for k in (m, b)}
    same = {k: sum(bool(per[k][e].get("same_continuation")) for e in both) for k in (m, b)}
    w, l, _ = paired(rows, m, b, "score")
    return (f"{task} {score[m]} vs {score[b]}, {w}/{l}, mean p = {mean_diff_p(paired_diffs(rows, m, b, 'score')):.3g}, "
            f"full's answer {same[m]}/{len(both)} vs {same[b]}/{len(both)}")


def _plots(out: Path, slug: str, summary: dict, sweep: dict, ttft: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    # 1. quality vs TTFT speedup
    pts = [(m, 1 / ttft[m]["ratio"], summary[m]) for m in ttft if m in summary and ttft[m]["ratio"]]
    if pts:
        markers = "os^vDP*Xhp<>"
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
        for ax, key, label in ((axes[0], "score", "task score"), (axes[1], "top1", "top-1 agreement with full"),
                               (axes[2], "kl", "KL(full ‖ method), first token")):
            for i, (m, sp, s) in enumerate(pts):
                ax.scatter(sp, s[key], marker=markers[i % len(markers)], s=50, label=m)
            ax.set_xlabel("TTFT speedup vs full (×, same run)")
            ax.set_ylabel(label)
            if key == "kl":
                ax.set_yscale("symlog", linthresh=1e-3)
            ax.grid(alpha=0.3)
        axes[2].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle("quality vs time to first token")
        fig.tight_layout()
        name = f"{slug}_quality_vs_ttft.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)
    # 2./3. quality and fidelity vs recompute ratio (measured share of chunk tokens recomputed)
    data = sweep or summary
    if not data:
        return files
    fams: dict[str, list] = defaultdict(list)
    for m, s in data.items():
        fams[parse_method(m).family].append((s["recompute_frac"], s))
    for key_set, title, fname in (((("score", "task score"),), "task score vs recompute ratio", "score_vs_r"),
                                  ((("kl", "KL(full ‖ method), first token"), ("top1", "top-1 agreement")),
                                   "fidelity to full vs recompute ratio", "fidelity_vs_r")):
        fig, axes = plt.subplots(1, len(key_set), figsize=(5 * len(key_set), 4), squeeze=False)
        for ax, (key, label) in zip(axes[0], key_set):
            for fam, pts_ in sorted(fams.items()):
                pts_ = sorted(pts_, key=lambda p: p[0])
                xs, ys = [p[0] for p in pts_], [p[1][key] for p in pts_]
                if fam in ("full", "reuse"):
                    ax.axhline(ys[0], ls="--", lw=1, color="gray" if fam == "reuse" else "black", label=fam)
                else:
                    ax.plot(xs, ys, marker="o", label=fam)
            ax.set_xlabel("share of chunk tokens recomputed")
            ax.set_ylabel(label)
            if key == "kl":
                ax.set_yscale("symlog", linthresh=1e-3)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(title)
        fig.tight_layout()
        name = f"{slug}_{fname}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files


def _command_lines(meta: dict) -> list[str]:
    """The command and date of every part the results were measured in (a resumed suite has several)."""
    parts = meta.get("parts") or [{"command": meta["environment"]["command"], "date": meta["environment"]["date"]}]
    if len(parts) == 1:
        return [f"- command: `{parts[0]['command']}`", f"- date: {parts[0]['date']}"]
    return [f"- measured in {len(parts)} parts:"] + [f"  - {p['date']}: `{p['command']}`" for p in parts]


ORDER = ("full", "reuse", "epic-k16", "cacheblend@0.15", "random@0.15", "qattn@0.15", "speccache@0.15", "norm@0.15")


def _methods(suite_methods: list[str], rows: list[dict]) -> tuple[list[str], list[str]]:
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


def _target_table(rows: list[dict], target: str, drafts: list[str], suite: dict) -> list[str]:
    """One table for a target scored by several drafts: draft-independent methods once, then each
    draft method per draft, on the prompts they all have, with TTFT ratios from the same rounds."""
    def label(r: dict) -> str:
        return r["method"] if r.get("draft") is None else f"{r['method']} ← {r['draft']}"

    present, _ = _methods(suite["methods"], [r for r in rows if r["kind"] == "quality" and r["target"] == target])
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
            lines.append(f"| {m} | {_fmt(q['recompute_frac'], pct=True)} | {_fmt(q['score'])} | "
                         + " | ".join(_fmt(q["per_task"].get(t)) for t in tasks)
                         + f" | {_fmt(q['kl'], 4)} | {_fmt(_relative(summary, m)[2], pct=True)} | "
                         f"{_fmt(q['top1'], 2)} | {_fmt(ratio)} | {_fmt(1 / ratio, 2) + '×' if ratio else '–'} |")
    return lines + [""]


def _prompt_lines(meta: dict, suite: dict, env: dict) -> list[str]:
    answers = (f"greedy, {suite['max_new_tokens']} new tokens"
               + (f", stopping at {' or '.join(repr(s) for s in suite['stop'])}" if suite.get("stop") else "")
               + (f"; system message {suite['system']!r}" if suite.get("system") else ""))
    if meta.get("longbench"):
        chunks = f"the first {suite['passages']} passages" if suite.get("passages") else "every passage"
        return [f"- prompts: LongBench file {meta['longbench']} — the first {suite['n_per_task']} rows, "
                f"{chunks} of each as one chunk; {answers}"]
    return [f"- prompts: synthetic — {suite['n_per_task']} per task × {', '.join(suite['tasks'])}; "
            f"{suite['n_chunks']} chunks × ~{suite['chunk_tokens']} target tokens; {answers}",
            f"- distractor prose: {PROSE_SOURCE} [{env['prose']}]"]


def write_report(out: str | Path) -> Path:
    """Build ``OUT/report.md`` (and PNGs beside it) from ``OUT/results.jsonl``; returns the report path."""
    out = Path(out)
    meta = json.loads((out / SUITE_FILE).read_text())
    suite, env = meta["suite"], meta["environment"]
    rows = read_rows(out / RESULTS)
    lines = [f"# Benchmark report — suite `{suite['name']}`", "", suite["description"], "",
             *_command_lines(meta),
             f"- machine: {env['machine']}, {env['cpu_count']} CPUs ({env['processor']}), torch {env['torch']} "
             f"({env['torch_threads']} threads), transformers {env['transformers']}, Python {env['python']}",
             *_prompt_lines(meta, suite, env),
             f"- TTFT: interleaved, {suite['ttft_warmup']} warm-up round + median of {suite['ttft_reps']} rounds per "
             f"prompt, ratio to full on the same prompt in the same process, geometric mean over prompts"
             + (f"; timed prompts: {suite['ttft_n_chunks']} chunks × ~{suite['ttft_chunk_tokens']} tokens"
                if suite.get("ttft_n_chunks") else ""),
             "- KL gap closed = 1 − KL(method) / KL(reuse): the share of naive reuse's divergence from full that the "
             "method's recompute removes (100 % = full, 0 % = no better than recomputing nothing).",
             "- task score: RULER string match (share of the reference values in the answer) for the synthetic "
             "tasks; word F1 (QA) or ROUGE-L (summaries) for LongBench files. Fidelity: first-token KL(full ‖ "
             "method), top-1 agreement, ROUGE-L of the greedy continuation against full's.", ""]
    # every (target, draft) the results hold: a directory resumed with other --pairs keeps the earlier ones
    pairs = list(dict.fromkeys([tuple(p) for p in suite["pairs"]]
                               + [(r["target"], r["draft"]) for r in rows if r.get("draft")]))
    drafts_of: dict[str, list[str]] = defaultdict(list)
    for target, draft in pairs:
        drafts_of[target].append(draft)
    for target, drafts in drafts_of.items():
        if len(drafts) > 1:
            lines += _target_table(rows, target, drafts, suite)
    for target, draft in pairs:
        pair = [target, draft]
        slug = _slug(suite["name"], target, draft)
        q = _pair_rows(rows, "quality", *pair)
        methods, partial = _methods(suite["methods"], q)
        summary, n = summarize(q, methods)
        sweep, n_sweep = summarize(q, suite["sweep_methods"]) if suite["sweep_methods"] else ({}, 0)
        ttft = ttft_summary(_pair_rows(rows, "ttft", *pair))
        agree = [r for r in rows if r["kind"] == "agreement" and r["target"] == target and r["draft"] == draft]
        lines += [f"## target `{target}` ← draft `{draft}`", ""]
        if not summary and not ttft:
            lines += ["(no results yet)", ""]
            continue
        if summary:
            lines += [f"### Every method ({n} prompts)", ""] + _headline_table(summary, ttft, methods) + [""]
            lines += ["Task score per task:", ""] + _task_table(summary, methods) + [""]
            for m in partial:
                part, n_part = summarize(q, ["full", "reuse", m])
                lines += [f"### {m} on {n_part} prompts (added after the rest ran; full and reuse on the same "
                          "prompts)", ""] + _headline_table(part, ttft, ["full", "reuse", m]) + [""]
        if ttft:
            lines += ["### Time to first token (seconds on this machine; compare ratios)", ""]
            lines += _ttft_table(ttft, suite["ttft_methods"]) + [""]
        if sweep:
            lines += [f"### Recompute-ratio sweep ({n_sweep} prompts)", ""] + _sweep_table(sweep, suite["sweep_methods"])
            lines += [""]
        if agree:
            lines += [f"### Agreement analysis ({len(agree)} prompts)", ""] + _agreement_lines(agree) + [""]
        if summary:
            lines += ["### Paired by prompt (sign test)", ""] + _paired_table(q, methods + partial) + [""]
        goals = _goals(summary, q)
        if goals:
            lines += ["### Against the goals of the quality issue (r = 0.15)", ""] + goals + [""]
        for f in _plots(out, slug, summary, sweep, ttft):
            lines += [f"![{f}]({f})", ""]
    path = out / REPORT
    path.write_text("\n".join(lines))
    return path
