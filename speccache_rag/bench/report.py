"""``report.md`` from a results directory (``results.jsonl`` + ``suite.json``): the run's setting, then per
(target, draft) pair the tables (report_tables), paired comparisons (report_paired) and plots (report_plots)."""
from __future__ import annotations

import json
import re
import warnings
from collections import defaultdict
from pathlib import Path

from .data import PROSE_SOURCE
from .methods import parse_method
from .report_paired import goal_lines, paired_table
from .report_plots import plots
from .report_tables import (agreement_lines, headline_table, summarize, sweep_table, tabulated_methods, target_table,
                            task_table, ttft_summary, ttft_table)
from .results import RESULTS, SUITE_FILE, read_rows

REPORT = "report.md"


def _slug(*parts: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", "_".join(parts).lower()).strip("-")


def _pair_rows(rows: list[dict], kind: str, target: str, draft: str) -> list[dict]:
    return [r for r in rows if r["kind"] == kind and r["target"] == target and r.get("draft") in (draft, None)]


def _command_lines(meta: dict) -> list[str]:
    """The command and date of every part the results were measured in (a resumed suite has several)."""
    parts = meta.get("parts") or [{"command": meta["environment"]["command"], "date": meta["environment"]["date"]}]
    if len(parts) == 1:
        return [f"- command: `{parts[0]['command']}`", f"- date: {parts[0]['date']}"]
    return [f"- measured in {len(parts)} parts:"] + [f"  - {p['date']}: `{p['command']}`" for p in parts]


def _prompt_lines(meta: dict, suite: dict, env: dict) -> list[str]:
    answers = (f"greedy, {suite['max_new_tokens']} new tokens"
               + (f", stopping at {' or '.join(repr(s) for s in suite['stop'])}" if suite.get("stop") else "")
               + (f"; system message {suite['system']!r}" if suite.get("system") else ""))
    if meta.get("longbench"):
        chunks = f"the first {suite['passages']} passages" if suite.get("passages") else "every passage"
        skip = min((part.get("skip", 0) for part in meta.get("parts") or []), default=0)
        rows = (f"rows {skip + 1}–{suite['n_per_task']} (--skip {skip})" if skip
                else f"the first {suite['n_per_task']} rows")
        return [f"- prompts: LongBench file {meta['longbench']} — {rows}, "
                f"{chunks} of each as one chunk; {answers}"]
    return [f"- prompts: synthetic — {suite['n_per_task']} per task × {', '.join(suite['tasks'])}; "
            f"{suite['n_chunks']} chunks × ~{suite['chunk_tokens']} target tokens; {answers}",
            f"- distractor prose: {PROSE_SOURCE} [{env['prose']}]"]


def _parsable(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """Rows whose method the bench still understands, and the names of those it no longer does (an option
    renamed or removed since they ran): those are left out with a warning rather than failing the report."""
    def parses(name: str) -> bool:
        try:
            parse_method(name)
        except ValueError:
            return False
        return True

    stale = [m for m in dict.fromkeys(r.get("method") for r in rows) if m is not None and not parses(m)]
    return [r for r in rows if r.get("method") not in stale], stale


def write_report(out: str | Path) -> Path:
    """Build ``OUT/report.md`` (and PNGs beside it) from ``OUT/results.jsonl``; returns the report path."""
    out = Path(out)
    meta = json.loads((out / SUITE_FILE).read_text())
    suite, env = meta["suite"], meta["environment"]
    rows, stale = _parsable(read_rows(out / RESULTS))
    if stale:
        warnings.warn(f"{out / RESULTS}: left out the rows of methods this version cannot parse: {', '.join(stale)}",
                      stacklevel=2)
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
    if stale:
        lines += [f"Left out: rows of {', '.join(f'`{m}`' for m in stale)}, a method spelling this version no longer "
                  "parses.", ""]
    # every (target, draft) the results hold: a directory resumed with other --pairs keeps the earlier ones
    pairs = list(dict.fromkeys([tuple(p) for p in suite["pairs"]]
                               + [(r["target"], r["draft"]) for r in rows if r.get("draft")]))
    drafts_of: dict[str, list[str]] = defaultdict(list)
    for target, draft in pairs:
        drafts_of[target].append(draft)
    for target, drafts in drafts_of.items():
        if len(drafts) > 1:
            lines += target_table(rows, target, drafts, suite)
    for target, draft in pairs:
        pair = [target, draft]
        slug = _slug(suite["name"], target, draft)
        q = _pair_rows(rows, "quality", *pair)
        methods, partial = tabulated_methods(suite["methods"], q)
        summary, n = summarize(q, methods)
        sweep, n_sweep = summarize(q, suite["sweep_methods"]) if suite["sweep_methods"] else ({}, 0)
        ttft = ttft_summary(_pair_rows(rows, "ttft", *pair))
        agree = [r for r in rows if r["kind"] == "agreement" and r["target"] == target and r["draft"] == draft]
        lines += [f"## target `{target}` ← draft `{draft}`", ""]
        if not summary and not ttft:
            lines += ["(no results yet)", ""]
            continue
        if summary:
            lines += [f"### Every method ({n} prompts)", ""] + headline_table(summary, ttft, methods) + [""]
            lines += ["Task score per task:", ""] + task_table(summary, methods) + [""]
            for m in partial:
                part, n_part = summarize(q, ["full", "reuse", m])
                lines += [f"### {m} on {n_part} prompts (added after the rest ran; full and reuse on the same "
                          "prompts)", ""] + headline_table(part, ttft, ["full", "reuse", m]) + [""]
        if ttft:
            lines += ["### Time to first token (seconds on this machine; compare ratios)", ""]
            lines += ttft_table(ttft, suite["ttft_methods"]) + [""]
        if sweep:
            lines += [f"### Recompute-ratio sweep ({n_sweep} prompts)", ""] + sweep_table(sweep, suite["sweep_methods"])
            lines += [""]
        if agree:
            lines += [f"### Agreement analysis ({len(agree)} prompts)", ""] + agreement_lines(agree) + [""]
        if summary:
            lines += ["### Paired by prompt (sign test)", ""] + paired_table(q, methods + partial) + [""]
        goals = goal_lines(summary, q)
        if goals:
            lines += ["### Against the goals of the quality issue (r = 0.15)", ""] + goals + [""]
        for f in plots(out, slug, summary, sweep, ttft):
            lines += [f"![{f}]({f})", ""]
    path = out / REPORT
    path.write_text("\n".join(lines))
    return path
