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


def _headline_table(summary: dict, ttft: dict, methods: list[str]) -> list[str]:
    lines = ["| method | recomputed | task score | F1 | KL(full ‖ m) | KL gap closed | top-1 agree | cont. ROUGE-L "
             "| same cont. | TTFT / full | speedup |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    kl_reuse = summary.get("reuse", {}).get("kl")
    for m in methods:
        if m not in summary:
            continue
        s, t = summary[m], ttft.get(m, {})
        ratio = t.get("ratio")
        closed = 1 - s["kl"] / kl_reuse if kl_reuse else None
        lines.append(f"| {m} | {_fmt(s['recompute_frac'], pct=True)} | {_fmt(s['score'])} | {_fmt(s['f1'])} | "
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


def _paired(by: dict[str, list[dict]], a: str, b: str, key: str, lower_is_better: bool = False) -> tuple[int, int]:
    """Prompts on which method a is better / worse than b by ``key`` (rows aligned by _by_method)."""
    better = worse = 0
    for ra, rb in zip(by.get(a, []), by.get(b, [])):
        diff = (rb[key] - ra[key]) if lower_is_better else (ra[key] - rb[key])
        better += diff > 0
        worse += diff < 0
    return better, worse


def _goals(summary: dict, ttft: dict, by: dict[str, list[dict]]) -> list[str]:
    sc, cb, ep, full = (summary.get(m) for m in ("speccache@0.15", "cacheblend@0.15", "epic-k16", "full"))
    if not sc or not full:
        return []
    out = []
    if full["score"] > 0:
        keep = sc["score"] / full["score"]
        out.append(f"- speccache@0.15 keeps {_fmt(keep, pct=True)} of full's task score (goal ≥ 98 %): "
                   f"{'met' if keep >= 0.98 else 'NOT met'}.")
    else:
        out.append("- full prefill scores 0 on these prompts: the task-score goal cannot be judged here; "
                   "see the fidelity columns.")
    for name, other in (("cacheblend@0.15", cb), ("epic-k16", ep)):
        if other:
            tasks = sorted(sc["per_task"])
            wins = [t for t in tasks if sc["per_task"][t] > other["per_task"].get(t, float("nan"))]
            ties = [t for t in tasks if sc["per_task"][t] == other["per_task"].get(t)]
            s_up, s_down = _paired(by, "speccache@0.15", name, "score")
            k_up, k_down = _paired(by, "speccache@0.15", name, "kl", lower_is_better=True)
            out.append(f"- vs {name}: speccache better on {len(wins)}/{len(tasks)} tasks"
                       f"{' (ties: ' + ', '.join(ties) + ')' if ties else ''}; KL {_fmt(sc['kl'], 4)} vs "
                       f"{_fmt(other['kl'], 4)}, top-1 {_fmt(sc['top1'], 2)} vs {_fmt(other['top1'], 2)}. Paired by "
                       f"prompt: higher task score on {s_up}, lower on {s_down}; lower KL on {k_up}, higher on {k_down}.")
    if "speccache@0.15" in ttft:
        sp = 1 / ttft["speccache@0.15"]["ratio"]
        out.append(f"- speccache@0.15 TTFT speedup vs full: {sp:.2f}× (goal ≥ 3.5× on the 1.5B target): "
                   f"{'met' if sp >= 3.5 else 'NOT met'} on this pair.")
    rnd = summary.get("random@0.15")
    if rnd:
        out.append(f"- plain norm selection vs random at r = 0.15: speccache score {_fmt(sc['score'])} / KL "
                   f"{_fmt(sc['kl'], 4)} / top-1 {_fmt(sc['top1'], 2)} vs random {_fmt(rnd['score'])} / "
                   f"{_fmt(rnd['kl'], 4)} / {_fmt(rnd['top1'], 2)}.")
    return out


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


def _target_table(rows: list[dict], target: str, drafts: list[str], suite: dict) -> list[str]:
    """One table for a target scored by several drafts: draft-independent methods once, then each
    draft method per draft, on the prompts they all have, with TTFT ratios from the same rounds."""
    def label(r: dict) -> str:
        return r["method"] if r.get("draft") is None else f"{r['method']} ← {r['draft']}"

    methods = [m for m in suite["methods"] if not parse_method(m).uses_draft]
    methods += [f"{m} ← {d}" for m in suite["methods"] if parse_method(m).uses_draft for d in drafts]
    relabel = lambda kind: [{**r, "method": label(r)} for r in rows if r["kind"] == kind and r["target"] == target
                            and r.get("draft") in (*drafts, None)]
    summary, n = summarize(relabel("quality"), methods)
    if not summary:
        return []
    ttft = ttft_summary(relabel("ttft"))
    tasks = sorted({t for v in summary.values() for t in v["per_task"]})
    kl_reuse = summary.get("reuse", {}).get("kl")
    lines = [f"### All drafts of `{target}` ({n} prompts)", "",
             "| method | recomputed | task score | " + " | ".join(tasks) + " | KL(full ‖ m) | KL gap closed | top-1 agree "
             "| TTFT / full | speedup |", "|---|" + "---:|" * (len(tasks) + 7)]
    for m in methods:
        if m in summary:
            q, ratio = summary[m], ttft.get(m, {}).get("ratio")
            lines.append(f"| {m} | {_fmt(q['recompute_frac'], pct=True)} | {_fmt(q['score'])} | "
                         + " | ".join(_fmt(q["per_task"].get(t)) for t in tasks)
                         + f" | {_fmt(q['kl'], 4)} | {_fmt(1 - q['kl'] / kl_reuse if kl_reuse else None, pct=True)} | "
                         f"{_fmt(q['top1'], 2)} | {_fmt(ratio)} | {_fmt(1 / ratio, 2) + '×' if ratio else '–'} |")
    return lines + [""]


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
             f"- prompts: {'LongBench file ' + meta['longbench'] if meta.get('longbench') else 'synthetic'} — "
             f"{suite['n_per_task']} per task × {', '.join(suite['tasks'])}; {suite['n_chunks']} chunks × "
             f"~{suite['chunk_tokens']} target tokens; greedy, {suite['max_new_tokens']} new tokens"
             + (f", stopping at {' or '.join(repr(s) for s in suite['stop'])}" if suite.get("stop") else ""),
             f"- distractor prose: {PROSE_SOURCE} [{env['prose']}]",
             f"- TTFT: interleaved, {suite['ttft_warmup']} warm-up round + median of {suite['ttft_reps']} rounds per "
             f"prompt, ratio to full on the same prompt in the same process, geometric mean over prompts"
             + (f"; timed prompts: {suite['ttft_n_chunks']} chunks × ~{suite['ttft_chunk_tokens']} tokens"
                if suite.get("ttft_n_chunks") else ""),
             "- KL gap closed = 1 − KL(method) / KL(reuse): the share of naive reuse's divergence from full that the "
             "method's recompute removes (100 % = full, 0 % = no better than recomputing nothing).",
             "- task score: RULER string match (share of the reference values in the answer) for the synthetic "
             "tasks; word F1 (QA) or ROUGE-L (summaries) for LongBench files. Fidelity: first-token KL(full ‖ "
             "method), top-1 agreement, ROUGE-L of the greedy continuation against full's.", ""]
    drafts_of: dict[str, list[str]] = defaultdict(list)
    for target, draft in suite["pairs"]:
        drafts_of[target].append(draft)
    for target, drafts in drafts_of.items():
        if len(drafts) > 1:
            lines += _target_table(rows, target, drafts, suite)
    for target, draft in suite["pairs"]:
        pair = [target, draft]
        slug = _slug(suite["name"], target, draft)
        q = _pair_rows(rows, "quality", *pair)
        summary, n = summarize(q, suite["methods"])
        sweep, n_sweep = summarize(q, suite["sweep_methods"]) if suite["sweep_methods"] else ({}, 0)
        ttft = ttft_summary(_pair_rows(rows, "ttft", *pair))
        agree = [r for r in rows if r["kind"] == "agreement" and r["target"] == target and r["draft"] == draft]
        lines += [f"## target `{target}` ← draft `{draft}`", ""]
        if not summary and not ttft:
            lines += ["(no results yet)", ""]
            continue
        if summary:
            lines += [f"### Every method ({n} prompts)", ""] + _headline_table(summary, ttft, suite["methods"]) + [""]
            lines += ["Task score per task:", ""] + _task_table(summary, suite["methods"]) + [""]
        if ttft:
            lines += ["### Time to first token (seconds on this machine; compare ratios)", ""]
            lines += _ttft_table(ttft, suite["ttft_methods"]) + [""]
        if sweep:
            lines += [f"### Recompute-ratio sweep ({n_sweep} prompts)", ""] + _sweep_table(sweep, suite["sweep_methods"])
            lines += [""]
        if agree:
            lines += [f"### Agreement analysis ({len(agree)} prompts)", ""] + _agreement_lines(agree) + [""]
        goals = _goals(summary, ttft, _by_method(q, suite["methods"])[0])
        if goals:
            lines += ["### Against the goals of issue 5", ""] + goals + [""]
        for f in _plots(out, slug, summary, sweep, ttft):
            lines += [f"![{f}]({f})", ""]
    path = out / REPORT
    path.write_text("\n".join(lines))
    return path
