"""How fidelity moves as the budget is spent step by step (issue 24: multi-round repair, a per-question budget).

    python -m speccache_rag.bench.budget_path --target qwen2.5-coder-1.5b --kv-store /tmp/kv15 \\
        --refs bench-results/musique-15b-nb2/refs --questions 20 --step 0.025 --upto 0.3

For each `musique` question whose chunks the bench stored in ``--kv-store``, the qattn first pass ranks the chunk
tokens; then the budget is spent in steps of ``--step``: each step recomputes the next-ranked tokens and the
question after them, and its last-token logits are compared with full prefill's (``--refs``: the bench's stored
references; else computed). Per question the path of first-token KL, and how far each step moved the answer's
distribution — the free signal a stop-when-settled budget would read.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from ..gate import first_token_fidelity
from ..prompt import TokenizedPrompt, render
from ..runner import full_prefill, prefill
from ..selection.base import budget_for
from ..selection.qattn import second_pass
from .budget_signals import first_pass


@torch.inference_mode()
def budget_path(engine, tokens: TokenizedPrompt, full_logits: torch.Tensor, step: float, upto: float) -> list[dict]:
    """The stored chunks of ``tokens`` loaded (neighbour variants as the default reads them), then repaired
    ``step`` of the chunk tokens at a time up to ``upto``, each step chosen and recomputed as a qattn round
    ranked by the first pass → one point per step: the share recomputed, KL(full ‖ step) and top-1, and
    ``moved``: KL(step ‖ previous step)."""
    first = first_pass(engine, tokens, upto)
    n, logits, taken = first.sel.reusable_positions.numel(), first.logits, first.always[:0]
    points = [{"r": 0.0, **first_token_fidelity(full_logits, logits)}]
    for k in range(1, round(upto / step) + 1):
        sel = replace(first.sel, budget=budget_for(min(upto, k * step), n))
        chosen, again = second_pass(first.probe, sel, first.always, taken, share=1.0)
        if chosen.numel() == 0:
            break
        taken = torch.cat([taken, chosen])
        previous, logits = logits, prefill(engine.ops, first.cache, tokens.ids[again], again)
        points.append({"r": taken.numel() / n, **first_token_fidelity(full_logits, logits),
                       "moved": first_token_fidelity(logits, previous)["kl"]})
    return points


def _full_logits(engine, tokens: TokenizedPrompt, refs: Path | None, target: str, example: str) -> torch.Tensor:
    from safetensors import safe_open

    from .suite_run import reference_path

    path = reference_path(refs, target, example) if refs else None
    if path is not None and path.exists():
        with safe_open(str(path), "pt") as f:
            return f.get_tensor("first_logits")
    return full_prefill(engine.ops, tokens.ids)[1]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m speccache_rag.bench.budget_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--kv-store", required=True, help="the bench's --kv-store (chunks of these questions)")
    p.add_argument("--refs", default=None, help="the bench's OUT/refs (full prefill's logits); else computed")
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--step", type=float, default=0.025)
    p.add_argument("--upto", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if not 0 < args.step <= args.upto <= 1:
        raise SystemExit(f"need 0 < --step <= --upto <= 1, got {args.step}, {args.upto}")
    from .. import SpecCacheEngine
    from .suite_run import _examples, _prompt
    from .suites import get_suite

    suite = get_suite("musique")
    engine = SpecCacheEngine.from_pretrained(args.target, store=args.kv_store, gate=False, warm_up=False,
                                             threads=args.threads)
    refs = Path(args.refs) if args.refs else None
    rows = []
    for ex in _examples(suite.replace(n_per_task=args.questions), engine.tokenizer, suite.longbench):
        tokens = render(_prompt(suite, ex), engine.tokenizer)
        full = _full_logits(engine, tokens, refs, args.target, ex.id)
        row = {"example": ex.id, "path": budget_path(engine, tokens, full, args.step, args.upto)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    steps = min(len(r["path"]) for r in rows)
    print(f"mean KL(full ‖ step) over {len(rows)} questions, by share recomputed:")
    for k in range(steps):
        print(f"  r = {rows[0]['path'][k]['r']:.3f}: {mean([r['path'][k]['kl'] for r in rows]):.3f}")
    for tau in (0.02, 0.01, 0.005):
        stops = [settled(r["path"], tau) for r in rows]
        print(f"stop once a step moves KL < {tau}: mean share {mean([s['r'] for s in stops]):.3f}, "
              f"mean KL {mean([s['kl'] for s in stops]):.3f}")
    best = [min((s for s in r["path"] if s["r"] <= 0.15 + args.step / 2), key=lambda s: s["kl"]) for r in rows]
    print(f"oracle: each question's best step within 0.15: mean KL {mean([s['kl'] for s in best]):.3f}")
    return rows


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def settled(path: list[dict], tau: float) -> dict:
    """The first step (after at least one) that moved the answer's distribution by less than ``tau``, else the last."""
    return next((s for s in path[1:] if s["moved"] < tau), path[-1])


if __name__ == "__main__":
    main()
