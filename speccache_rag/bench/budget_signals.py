"""Can a question tell, before any recompute, how much budget it needs? (issue 24, the per-question budget)

    python -m speccache_rag.bench.budget_signals --target qwen2.5-coder-1.5b --kv-store /tmp/kv15 \\
        --results bench-results/musique-15b-nb2/results.jsonl --questions 20

For each `musique` question whose chunks the bench stored in ``--kv-store`` (same target, dtype and sink), the
qattn first pass — the question over the reused chunk KV, what the default computes anyway — gives signals a
per-question budget could read for free: the share of the question's attention mass the top 5 / 15 / 25 % of chunk
tokens hold, the share of tokens holding half the mass, the entropy and top probability of the reuse answer's
first token. Each is ranked against what the question turned out to need, from the bench's rows: qattn@0.15's
first-token KL to full prefill (what is left at the fixed budget) and the KL that r = 0.25 removes on top.
Spearman's rho over the questions; a usable signal is strong and consistent on both.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ReuseConfig
from ..output import GenerationStats
from ..prompt import TokenizedPrompt, render
from ..runner import KVCache, prefill
from ..selection.base import Selection, budget_for
from ..selection.qattn import QuestionAttention, question_probe
from .results import read_rows

SIGNALS = ("mass_top5", "mass_top15", "mass_top25", "share_for_half", "entropy", "top_prob")


@dataclass
class FirstPass:
    """The default's first pass over a prompt's stored chunks: the cache it filled, its selection at ``ratio``,
    the always-recomputed positions, the question's attention over the reused KV, and the last-token logits."""
    cache: KVCache
    sel: Selection
    always: torch.Tensor
    probe: QuestionAttention
    logits: torch.Tensor
    stats: GenerationStats


@torch.inference_mode()
def first_pass(engine, tokens: TokenizedPrompt, ratio: float = 0.15) -> FirstPass:
    """Load ``tokens``' stored chunks as the default reads them (neighbour variants included), then prefill the
    always-recomputed positions over them, observing the question's attention."""
    cache = KVCache.empty(engine.ops, len(tokens) + 1)
    stats = GenerationStats(method="qattn", prompt_tokens=len(tokens))
    reusable, _ = engine.blender.load(tokens, cache, stats, neighbors=ReuseConfig().neighbors)
    sel = Selection(tokens, reusable, budget_for(ratio, int(reusable.sum())), ReuseConfig())
    always = (~reusable).nonzero().flatten()
    probe = question_probe(engine.ops, sel, always)
    logits = prefill(engine.ops, cache, tokens.ids[always], always, observe=probe)
    return FirstPass(cache, sel, always, probe, logits, stats)


def signals(engine, prompt) -> dict:
    """The qattn first pass over ``prompt``'s stored chunks → the signals (and how many chunks were hits)."""
    first = first_pass(engine, render(prompt, engine.tokenizer))
    stats, p = first.stats, first.logits.float().softmax(-1)
    scores = first.probe.scores[first.sel.reusable].float().clamp_min(0).sort(descending=True).values
    mass = scores.cumsum(0) / scores.sum()
    n = scores.numel()
    return {"hits": stats.cache_hits, **{f"mass_top{q}": float(mass[max(0, round(q / 100 * n) - 1)])
                                         for q in (5, 15, 25)},
            "share_for_half": float((mass < 0.5).sum() + 1) / n,
            "entropy": float(-(p * p.clamp_min(1e-12).log()).sum()), "top_prob": float(p.max())}


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m speccache_rag.bench.budget_signals", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--kv-store", required=True, help="the bench's --kv-store (chunks of these questions)")
    p.add_argument("--results", required=True, help="the bench's results.jsonl with qattn@0.15 and qattn@0.25 rows")
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    from .. import SpecCacheEngine
    from .suite_run import _examples, _prompt
    from .suites import get_suite

    kl: dict[str, dict[str, float]] = {}
    for row in read_rows(Path(args.results)):
        if row["kind"] == "quality" and row["target"] == args.target:
            kl.setdefault(row["example"], {})[row["method"]] = row["kl"]
    suite = get_suite("musique")
    engine = SpecCacheEngine.from_pretrained(args.target, store=args.kv_store, gate=False, warm_up=False,
                                             threads=args.threads)
    rows = []
    for ex in _examples(suite.replace(n_per_task=args.questions), engine.tokenizer, suite.longbench):
        need = kl.get(ex.id, {})
        if "qattn@0.15" not in need or "qattn@0.25" not in need:
            continue
        row = {"example": ex.id, **signals(engine, _prompt(suite, ex)), "kl_015": need["qattn@0.15"],
               "kl_removed_by_025": need["qattn@0.15"] - need["qattn@0.25"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if len(rows) < 3:
        raise SystemExit(f"{len(rows)} questions have qattn@0.15 and qattn@0.25 rows for {args.target} in {args.results}")
    table = {s: {"left_at_015": spearman([r[s] for r in rows], [r["kl_015"] for r in rows]),
                 "removed_by_025": spearman([r[s] for r in rows], [r["kl_removed_by_025"] for r in rows])}
             for s in SIGNALS}
    print(f"Spearman rho over {len(rows)} questions (signal vs what the question needed):")
    for s, v in table.items():
        print(f"  {s:15s} left at r=0.15: {v['left_at_015']:+.2f}   removed by r=0.25: {v['removed_by_025']:+.2f}")
    return {"questions": len(rows), "rows": rows, "spearman": table}


if __name__ == "__main__":
    main()
