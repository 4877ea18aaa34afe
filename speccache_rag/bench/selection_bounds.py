"""How far can any choice of chunk tokens go at a fixed budget on real text? (issue 24: the scorer or the budget?)

    python -m speccache_rag.bench.selection_bounds --target qwen2.5-coder-1.5b --questions 20 --threads 1

For each `musique` question, full prefill shows what no selector sees at query time: the question's attention
over the *true* KV, and how far each reused chunk token's values are from the truth. Scorers that read them
(oracles) bound what a better query-time scorer could reach at the same budget:

- ``qattn``: the default, the question's attention over the stale KV (deeper half of the layers, mean over heads);
- ``attn``: the same score over full prefill's KV (what ``qattn`` estimates);
- ``dev``: the values' relative error ‖V − V_full‖ / ‖V_full‖, mean over layers (what CacheBlend estimates);
- ``impact``: over every layer and head, the question's true attention × ‖V − V_full‖: how far a stale token
  moves the question's attention output;
- ``impact-stale``: the same with the question's attention over the stale KV (only the deviation is an oracle);
- ``vnorm``: the question's stale attention × ‖V‖ over every layer and head (value-aware, query-time only);
- ``both``: ``qattn``'s score plus ``attn``'s, each summing to one: the tokens the stale KV draws the question to
  and those the true KV would (``attn`` alone misses the first kind).

Each recomputes its chosen tokens and the question; first-token KL(full ‖ m), top-1, and the share of reuse's KL
(nothing recomputed) closed. Chunks are the plain entries (computed here when ``--kv-store`` lacks them).
"""
from __future__ import annotations

import argparse
import json

import torch

from ..config import ReuseConfig
from ..gate import first_token_fidelity
from ..output import GenerationStats
from ..prompt import TokenizedPrompt, render
from ..runner import KVCache, full_prefill, prefill
from ..selection import SELECTORS
from ..selection.base import Selection, budget_for, top_positions
from ..selection.qattn import QuestionAttention, question_start, scored_layers
from .metrics import mean
from .report_paired import sign_test_p

SCORERS = ("qattn", "attn", "dev", "impact", "impact-stale", "vnorm", "both")


class PerLayerAttention(QuestionAttention):
    """Keeps each layer's per-head attention of the question rows [H, T] instead of a running score."""

    def __init__(self, ops, tokens: TokenizedPrompt, positions: torch.Tensor):
        rows = (positions >= question_start(tokens)).nonzero().flatten()
        super().__init__(rows, positions[rows], range(ops.num_layers), ops.scaling, len(tokens))
        self.by_layer: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        self.by_layer[layer] = self.attention(q, k)


def _copy(cache: KVCache) -> KVCache:
    return KVCache(cache.k.clone(), cache.v.clone())


def value_weighted(att: dict[int, torch.Tensor], values: torch.Tensor, n: int) -> torch.Tensor:
    """Σ over layers and heads of attention [H, T] × ‖values‖ ([L, KVH, T, D], shared by a group of heads) → [n]."""
    out = torch.zeros(n)
    for layer, a in att.items():
        norm = values[layer, :, : a.shape[1]].float().norm(dim=-1)                      # [KVH, T]
        out[: a.shape[1]] += (a * norm.repeat_interleave(a.shape[0] // norm.shape[0], 0)).sum(0).cpu()
    return out


@torch.inference_mode()
def bounds(engine, tokens: TokenizedPrompt, ratios: list[float], scorers: tuple[str, ...] = SCORERS) -> dict:
    """One prompt: each scorer at every ratio → {"reuse": fidelity, "<scorer>@<r>": fidelity}."""
    ops, n = engine.ops, len(tokens)
    everything = torch.arange(n, device=ops.device)
    truth = PerLayerAttention(ops, tokens, everything)
    full, full_logits = full_prefill(ops, tokens.ids, observe=truth)

    stale = KVCache.empty(ops, n)
    reusable, _ = engine.blender.load(tokens, stale, GenerationStats(method="reuse", prompt_tokens=n), neighbors="off")
    always = (~reusable).nonzero().flatten()
    first = PerLayerAttention(ops, tokens, always)
    reused = _copy(stale)
    row = {"reuse": first_token_fidelity(full_logits, prefill(ops, reused, tokens.ids[always], always, observe=first))}

    deep = scored_layers(ops.num_layers, ReuseConfig().qattn_layers)
    error = full.v.float() - stale.v.float()
    rel = (error.pow(2).sum((1, 3)).sqrt() / full.v.float().pow(2).sum((1, 3)).sqrt().clamp_min(1e-6)).mean(0)
    candidates = reusable.nonzero().flatten()
    true_attn = sum(truth.by_layer[i].mean(0) for i in deep).cpu()
    stale_attn = sum(first.by_layer[i].mean(0) for i in deep).cpu()
    cand = candidates.cpu()
    scores = {
        "attn": true_attn,
        "dev": rel.cpu(),
        "impact": value_weighted(truth.by_layer, error, n),
        "impact-stale": value_weighted(first.by_layer, error, n),
        "vnorm": value_weighted(first.by_layer, reused.v, n),
        "both": stale_attn / stale_attn[cand].sum() + true_attn / true_attn[cand].sum(),
    }
    scores = {k: v for k, v in scores.items() if k in scorers}
    for r in ratios:
        budget = budget_for(r, candidates.numel())
        cfg = ReuseConfig(recompute_ratio=r)
        logits, _ = SELECTORS["qattn"](ops, _copy(stale), Selection(tokens, reusable, budget, cfg), always)
        row[f"qattn@{r}"] = first_token_fidelity(full_logits, logits)   # the baseline: always run
        for name, s in scores.items():
            chosen = top_positions(s.to(ops.device), candidates, budget)
            again = torch.cat([chosen, always]).unique()
            row[f"{name}@{r}"] = first_token_fidelity(full_logits, prefill(ops, _copy(stale), tokens.ids[again], again))
    return row


def summary(rows: list[dict]) -> list[str]:
    """Mean KL, gap closed and top-1 per scorer; KL wins / losses against qattn at the same ratio."""
    reuse = mean([r["reuse"]["kl"] for r in rows])
    lines = [f"{len(rows)} questions, reuse KL {reuse:.3f}",
             "| scorer | KL(full ‖ m) | KL gap closed | top-1 | KL vs qattn, W/L (sign p) |", "|---|---:|---:|---:|---:|"]
    for name in (k for k, v in rows[0].items() if k != "reuse" and isinstance(v, dict)):
        kl = mean([r[name]["kl"] for r in rows])
        base = "qattn@" + name.split("@")[1]
        w = sum(r[name]["kl"] < r[base]["kl"] for r in rows)
        lo = sum(r[name]["kl"] > r[base]["kl"] for r in rows)
        vs = "–" if name == base else f"{w}/{lo} ({sign_test_p(w, lo):.2g})"
        lines.append(f"| {name} | {kl:.3f} | {100 * (1 - kl / reuse):.0f} % | "
                     f"{mean([r[name]['top1'] for r in rows]):.2f} | {vs} |")
    return lines


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m speccache_rag.bench.selection_bounds",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--kv-store", default="memory://", help="where the plain chunk KV is kept (default: in memory)")
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--skip", type=int, default=0, help="start after this many questions")
    p.add_argument("--ratios", default="0.15")
    p.add_argument("--scorers", default=",".join(SCORERS), help="default: %(default)s")
    p.add_argument("--passages", type=int, default=None, help="passages per question (default: the suite's)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    from .. import SpecCacheEngine
    from .suite_run import _examples, _prompt
    from .suites import get_suite

    suite = get_suite("musique")
    if args.passages is not None:
        suite = suite.replace(passages=args.passages)
    ratios = [float(r) for r in args.ratios.split(",")]
    scorers = tuple(args.scorers.split(","))
    if unknown := set(scorers) - set(SCORERS):
        raise SystemExit(f"unknown scorers {sorted(unknown)}; known: {', '.join(SCORERS)}")
    engine = SpecCacheEngine.from_pretrained(args.target, store=args.kv_store, gate=False, warm_up=False,
                                             threads=args.threads)
    rows = []
    examples = _examples(suite.replace(n_per_task=args.skip + args.questions), engine.tokenizer, suite.longbench)
    for ex in examples[args.skip:]:
        prompt = _prompt(suite, ex)
        engine.precompute(prompt.chunks)
        row = {"example": ex.id, **bounds(engine, render(prompt, engine.tokenizer), ratios, scorers)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n".join(summary(rows)))
    return rows


if __name__ == "__main__":
    main()
