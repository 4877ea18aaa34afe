"""``make gpu-check``: the checks that need an accelerator, in one run — or a clear "no CUDA here", exit 0.

On the device (default: CUDA) with a packaged model: (1) exactness, every method at r = 1 against full prefill
(same greedy tokens, first-token logits within the gate's tolerance); (2) a quality smoke, qattn@0.15 closes
part of naive reuse's first-token KL gap on the demo questions; (3) a TTFT table, full prefill against every
method at r = 0.15, ratios measured in this one run. ``--device cpu`` runs the same checks here, so the script
itself is tested where no GPU is. The torch engine only: the vLLM connector runs on the worker's device and is
checked by ``tests/test_vllm.py`` in a GPU build of vLLM.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from ..config import METHODS, ReuseConfig
from ..gate import first_token_fidelity, logits_mismatch
from ..prompt import RAGPrompt
from .metrics import mean, median


def _prompts(tokenizer, n: int = 3, top_k: int = 4) -> list[RAGPrompt]:
    """The demo's first questions over their best chunks of the shipped documents."""
    from ..chunking import chunk_documents, load_documents, rank_chunks, token_counter
    from ..data import demo_dir, demo_questions

    chunks = [c.text for c in chunk_documents(load_documents([demo_dir()], strict=True), count=token_counter(tokenizer))]
    return [RAGPrompt(chunks=[chunks[i] for i in rank_chunks(q["question"], chunks, top_k)], question=q["question"])
            for q in demo_questions()[:n]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m speccache_rag.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"no CUDA device here (torch {torch.__version__}{'' if torch.version.cuda else ', a CPU build'}): "
              "nothing to check; run it on a GPU machine")
        return 0
    from ..engine import SpecCacheEngine

    engine = SpecCacheEngine.from_pretrained(args.target, store="memory://", device=args.device)
    print(f"{args.target} on {engine.ops.device} ({engine.dtype}); {engine.load_stats.gate_line()}")
    prompts = _prompts(engine.tokenizer)
    for prompt in prompts:
        engine.precompute(prompt.chunks)
    failures = []

    def run(prompt, method, ratio, new=8):
        return engine.generate(prompt, max_new_tokens=new, reuse=ReuseConfig(method=method, recompute_ratio=ratio),
                               return_first_logits=True)

    full_logits = []
    for prompt in prompts:                                   # (1) exactness
        full = run(prompt, "full", 1.0)
        full_logits.append(full.first_logits)
        for method in (m for m in METHODS if m not in ("full", "reuse")):
            out = run(prompt, method, 1.0)
            wrong = logits_mismatch(out.first_logits, full.first_logits, engine.ops.dtype)
            if out.token_ids != full.token_ids or wrong:
                failures.append(f"exactness: {method} at r = 1 differs from full prefill")
    print(f"exactness: {len(METHODS) - 2} methods × {len(prompts)} prompts, {len(failures)} failed")

    closed = []                                              # (2) quality smoke
    for prompt, ref in zip(prompts, full_logits):
        kl_reuse, kl_q = (first_token_fidelity(ref, run(prompt, m, r, 1).first_logits)["kl"]
                          for m, r in (("reuse", 0.0), ("qattn", 0.15)))
        closed.append(1 - kl_q / kl_reuse if kl_reuse > 0 else 1.0)
    print(f"quality: qattn@0.15 closes {mean(closed):.0%} of reuse's KL gap (mean of {len(closed)})")
    if mean(closed) <= 0:
        failures.append("quality: qattn@0.15 is no closer to full prefill than naive reuse")

    print("| method | TTFT (s, median) | × full |\n|---|---:|---:|")    # (3) TTFT, one run, interleaved
    methods = ["full", "qattn", "cacheblend", "epic", "speccache"]
    times = {m: [] for m in methods}
    for _ in range(args.reps + 1):                           # the first round warms up
        for m in methods:
            t = time.perf_counter()
            run(prompts[0], m, 0.15 if m != "full" else 1.0, 1)
            if engine.ops.device.type == "cuda":
                torch.cuda.synchronize()
            times[m].append(time.perf_counter() - t)
    base = median(times["full"][1:])
    for m in methods:
        med = median(times[m][1:])
        print(f"| {m} | {med:.3f} | {base / med:.2f}× |")
    for f in failures:
        print(f"FAILED {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
