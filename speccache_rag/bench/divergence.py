"""Where reused KV diverges from full prefill (issue 24): per layer, per position inside a chunk, per chunk,
and for the tokens a method recomputed against those it left stale.

For each prompt: full prefill's cache is the reference; the blended caches of ``reuse`` (nothing recomputed)
and of the given methods are compared with it, value rows and (rotated) key rows, as relative L2 distance
‖x − x_full‖ / ‖x_full‖ per token and layer.

    python -m speccache_rag.bench.divergence --target qwen2.5-coder-0.5b --prompts 6 \\
        --longbench ../shared/data/musique_dev.jsonl --passages 6 --methods qattn@0.15,epic@0.15
    python -m speccache_rag.bench.divergence --target qwen2.5-coder-0.5b --prompts 6 --synthetic 8x256
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict

import torch

from ..output import GenerationStats
from ..prompt import RAGPrompt, render
from ..runner import KVCache
from .data import load_longbench, synthetic, tokenizer_counter
from .methods import BenchEngine, parse_method

# token offsets inside a chunk: where the stale KV sits
BUCKETS = ((0, 4), (4, 16), (16, 64), (64, 256), (256, 10**9))


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[L, H, T, D] pairs → [L, T]: per layer and token, ‖a − b‖ / ‖b‖ over heads and dims."""
    a, b = a.float(), b.float()
    return (a - b).pow(2).sum((1, 3)).sqrt() / b.pow(2).sum((1, 3)).sqrt().clamp_min(1e-6)


def _blend(engine: BenchEngine, tokens, prompt: RAGPrompt, method: str) -> tuple[KVCache, torch.Tensor]:
    spec = parse_method(method)
    cache = KVCache.empty(engine.ops, len(tokens))
    stats = GenerationStats(method=spec.family, prompt_tokens=len(tokens))
    out = engine.blender.blend(tokens, cache, spec.reuse_config(), stats, prompt=prompt)
    return cache, out.recomputed


def analyse(engine: BenchEngine, prompt: RAGPrompt, methods: list[str]) -> dict:
    tokens = render(prompt, engine.tokenizer)
    engine.precompute(prompt.chunks)
    full, _ = _blend(engine, tokens, prompt, "full")
    segs = [s for s in tokens.chunk_segments() if s.end > s.start]
    n, layers = len(tokens), engine.ops.num_layers
    offset = torch.full((n,), -1)
    chunk_of = torch.full((n,), -1)
    for s in segs:
        offset[s.start:s.end] = torch.arange(s.end - s.start)
        chunk_of[s.start:s.end] = s.chunk
    in_chunk = offset >= 0
    row: dict = {"tokens": n, "chunks": len(segs), "chunk_tokens": int(in_chunk.sum())}
    for method in ["reuse", *methods]:
        cache, recomputed = _blend(engine, tokens, prompt, method)
        dv, dk = _rel(cache.v, full.v), _rel(cache.k, full.k)          # [L, T]
        stale = in_chunk.clone()
        stale[recomputed] = False
        picked = in_chunk & ~stale
        r = {"layer_v": dv[:, in_chunk].mean(1).tolist(), "layer_k": dk[:, in_chunk].mean(1).tolist(),
             "v_stale": float(dv[:, stale].mean()) if stale.any() else 0.0,
             "v_picked": float(dv[:, picked].mean()) if picked.any() else 0.0,
             "picked": int(picked.sum()),
             "picked_by_bucket": {}, "v_by_bucket": {}, "v_by_chunk": {}}
        deep = dv[layers // 2:]                                          # the deeper half, where answers form
        for lo, hi in BUCKETS:
            m = in_chunk & (offset >= lo) & (offset < hi)
            if m.any():
                r["v_by_bucket"][f"{lo}-{hi}"] = float(deep[:, m & stale].mean()) if (m & stale).any() else 0.0
                r["picked_by_bucket"][f"{lo}-{hi}"] = float(picked[m].float().mean())
        for c in sorted({s.chunk for s in segs}):
            m = chunk_of == c
            r["v_by_chunk"][c] = float(deep[:, m].mean())
        row[method] = r
    return row


def _mean_dicts(ds: list[dict]) -> dict:
    acc: dict = defaultdict(list)
    for d in ds:
        for k, v in d.items():
            acc[k].append(v)
    return {k: sum(v) / len(v) for k, v in acc.items()}


def report(rows: list[dict], methods: list[str], label: str) -> str:
    n = len(rows)
    lines = [f"### {label}: {n} prompts, {sum(r['tokens'] for r in rows) / n:.0f} tokens, "
             f"{sum(r['chunks'] for r in rows) / n:.1f} chunks on average", ""]
    layers = len(rows[0]["reuse"]["layer_v"])
    cut = [0, layers // 4, layers // 2, 3 * layers // 4, layers - 1]
    lines += ["| method | recomputed chunk tokens | V rel. error, stale tokens | V rel. error, recomputed | "
              + " | ".join(f"V err. layer {i}" for i in cut) + " |",
              "|---|---:|---:|---:|" + "---:|" * len(cut)]
    for m in ["reuse", *methods]:
        rs = [r[m] for r in rows]
        lv = [sum(r["layer_v"][i] for r in rs) / n for i in cut]
        lines.append(f"| {m} | {sum(r['picked'] for r in rs) / n:.0f} | {sum(r['v_stale'] for r in rs) / n:.3f} | "
                     f"{sum(r['v_picked'] for r in rs) / n:.3f} | " + " | ".join(f"{x:.3f}" for x in lv) + " |")
    buckets = list(rows[0]["reuse"]["v_by_bucket"])
    lines += ["", "Deeper-half V error of stale tokens by offset inside their chunk (and the share each method "
              "recomputed there):", "",
              "| method | " + " | ".join(f"tokens {b}" for b in buckets) + " |", "|---|" + "---:|" * len(buckets)]
    for m in ["reuse", *methods]:
        v = _mean_dicts([r[m]["v_by_bucket"] for r in rows])
        p = _mean_dicts([r[m]["picked_by_bucket"] for r in rows])
        lines.append(f"| {m} | " + " | ".join(f"{v.get(b, 0):.3f} ({100 * p.get(b, 0):.0f} %)" for b in buckets)
                     + " |")
    chunks = _mean_dicts([{int(k): v for k, v in r["reuse"]["v_by_chunk"].items()} for r in rows])
    lines += ["", "reuse, deeper-half V error by chunk index: "
              + ", ".join(f"#{c + 1} {v:.3f}" for c, v in sorted(chunks.items())), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m speccache_rag.bench.divergence", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--longbench", default=None, help="a LongBench JSONL file (else synthetic prompts)")
    p.add_argument("--passages", type=int, default=6)
    p.add_argument("--synthetic", default="8x256", help="synthetic prompts: CHUNKSxTOKENS (default: %(default)s)")
    p.add_argument("--system", default=None)
    p.add_argument("--methods", default="qattn@0.15,epic@0.15,cacheblend@0.15")
    args = p.parse_args(argv)
    from ..models import load

    model, tok = load(args.target, dtype=args.dtype)
    engine = BenchEngine(model, tok, store="memory://", name=args.target)
    count = tokenizer_counter(tok)
    if args.longbench:
        exs = [dataclasses.replace(e, chunks=e.chunks[: args.passages])
               for e in load_longbench(args.longbench, count=count)][: args.prompts]
        label = f"{args.longbench} (first {args.passages} passages)"
    else:
        k, _, size = args.synthetic.partition("x")
        exs = synthetic(-(-args.prompts // 3), 0, int(k), int(size), count=count)[: args.prompts]
        label = f"synthetic {args.synthetic}"
    methods = [m for m in args.methods.split(",") if m]
    system = {} if args.system is None else {"system": args.system}
    rows = [analyse(engine, RAGPrompt(chunks=e.chunks, question=e.question, **system), methods) for e in exs]
    print(report(rows, methods, f"{args.target} — {label}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
