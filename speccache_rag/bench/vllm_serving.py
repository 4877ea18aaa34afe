"""Benchmark: requests/s and TTFT (median, p90) of a batch of RAG requests on vLLM, full prefill vs
SpecCache (and any other method), reported as ratios from one run of one engine.

    python -m speccache_rag.bench.vllm_serving --target qwen2.5-coder-0.5b --draft smollm2-135m \\
        --requests 8 --chunks-per-request 4 --max-new-tokens 16 --json results/vllm_bench.json
    python -m speccache_rag.bench.vllm_serving --workload rag --target qwen2.5-coder-0.5b --draft smollm2-135m \\
        --methods prefix-cache speccache     # 40 queries × 6 of 30 chunks: vLLM's prefix caching vs the connector

Method ``prefix-cache`` is what vLLM users run today: plain full prefill with vLLM's automatic prefix
caching, the requests of a round sharing one cache salt, so a request hits the blocks of any earlier
request of the round with the same prefix (system prompt, and the first chunk when it recurs first).

Workload: the demo documents cut into chunks of about ``--chunk-tokens`` tokens, all precomputed
first (not timed); each request asks one demo question over ``--chunks-per-request`` chunks (its
source documents' chunks first, then random others, shuffled), so requests have different chunk
sets and orders. All requests of a method are submitted at once (vLLM batches them); methods
alternate for ``--rounds`` rounds. Every full-prefill request carries a unique cache salt and the
connector keeps every blended request's blocks private, so vLLM's prefix cache never serves one request's
prompt to another: each method computes every request cold.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from ..config import ReuseConfig
from ..prompt import RAGPrompt


PREFIX_CACHE = "prefix-cache"


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def demo_workload(tokenizer, requests: int, chunks_per_request: int, chunk_tokens: int = 200,
                  seed: int = 0) -> tuple[list[str], list[RAGPrompt]]:
    """(every chunk text, the request prompts) from the packaged demo documents."""
    from ..chunking import Document, chunk_documents, token_counter
    from ..data import demo_documents, demo_questions

    docs = [Document(name, text) for name, text in demo_documents()]
    chunks = chunk_documents(docs, max_tokens=chunk_tokens, count=token_counter(tokenizer))
    texts = [c.text for c in chunks]
    questions = demo_questions()
    rng = random.Random(seed)
    prompts = []
    for i in range(requests):
        q = questions[i % len(questions)]
        own = [j for j, c in enumerate(chunks) if c.source in q["sources"]]
        others = [j for j in range(len(chunks)) if j not in own]
        rng.shuffle(others)
        picked = (own + others)[:chunks_per_request]
        rng.shuffle(picked)
        prompts.append(RAGPrompt(chunks=[texts[j] for j in picked], question=q["question"]))
    return texts, prompts


def rag_workload(tokenizer, queries: int = 40, corpus: int = 30, chunks_per_request: int = 6,
                 chunk_tokens: int = 120, seed: int = 0) -> tuple[list[str], list[RAGPrompt]]:
    """A corpus of ``corpus`` demo chunks; each query retrieves ``chunks_per_request`` of them (its question's
    source chunks among them when they are in the corpus), in a random order."""
    from ..chunking import Document, chunk_documents, token_counter
    from ..data import demo_documents, demo_questions

    docs = [Document(name, text) for name, text in demo_documents()]
    chunks = chunk_documents(docs, max_tokens=chunk_tokens, count=token_counter(tokenizer))[:corpus]
    if len(chunks) < max(corpus, chunks_per_request):
        raise ValueError(f"the demo documents give {len(chunks)} chunks of {chunk_tokens} tokens; lower --chunk-tokens")
    questions = demo_questions()
    rng = random.Random(seed)
    prompts = []
    for i in range(queries):
        q = questions[i % len(questions)]
        own = [j for j, c in enumerate(chunks) if c.source in q["sources"]][: chunks_per_request // 2]
        others = [j for j in range(len(chunks)) if j not in own]
        picked = own + rng.sample(others, chunks_per_request - len(own))
        rng.shuffle(picked)
        prompts.append(RAGPrompt(chunks=[chunks[j].text for j in picked], question=q["question"]))
    return [c.text for c in chunks], prompts


def run_bench(engine, prompts: list[RAGPrompt], max_new_tokens: int = 16, methods=("full", "speccache"),
              recompute_ratio: float = 0.15, rounds: int = 1, baseline: str = "full") -> dict:
    """Run each method's batch ``rounds`` times (methods interleaved) on one engine → metrics and ratios."""
    ttfts: dict[str, list[float]] = {m: [] for m in methods}
    walls: dict[str, list[float]] = {m: [] for m in methods}
    recomputed: dict[str, list[float]] = {m: [] for m in methods}
    hits: dict[str, list[int]] = {m: [] for m in methods}
    for r in range(rounds):
        for m in methods:
            reuse = ReuseConfig(method="full" if m == PREFIX_CACHE else m, recompute_ratio=recompute_ratio)
            t = time.perf_counter()
            # full prefill computed cold: a fresh salt per round (and per request, but for the prefix-cache
            # baseline); blended requests carry none (the connector keeps their blocks private, and a salt
            # would be a tenant without chunks)
            cold = {"cache_salt": f"bench-{r}-{m}-{time.time_ns()}", "salt_per_request": m != PREFIX_CACHE}
            outs = engine.generate_many(prompts, max_new_tokens=max_new_tokens, reuse=reuse,
                                        **(cold if reuse.method == "full" else {}))
            walls[m].append(time.perf_counter() - t)
            ttfts[m] += [o.stats.ttft_s for o in outs]
            recomputed[m] += [o.stats.recomputed_tokens / o.stats.prompt_tokens for o in outs]
            hits[m] += [o.stats.cache_hits for o in outs]
    n = len(prompts)
    result = {"requests": n, "rounds": rounds, "max_new_tokens": max_new_tokens, "recompute_ratio": recompute_ratio,
              "prompt_tokens_mean": None, "methods": {}, "ratios": {}}
    for m in methods:
        result["methods"][m] = {
            "requests_per_s": n * rounds / sum(walls[m]),
            "ttft_median_s": statistics.median(ttfts[m]),
            "ttft_p90_s": _quantile(ttfts[m], 0.9),
            "recomputed_share_mean": statistics.mean(recomputed[m]),
            "cache_hits_mean": statistics.mean(hits[m]),
        }
    for baseline in [b for b in (baseline, PREFIX_CACHE) if b in methods]:
        base = result["methods"][baseline]
        for m in methods:
            if m == baseline:
                continue
            cur = result["methods"][m]
            result["ratios"][f"{m}_vs_{baseline}"] = {
                "requests_per_s": cur["requests_per_s"] / base["requests_per_s"],
                "ttft_median": base["ttft_median_s"] / cur["ttft_median_s"],     # > 1: m starts sooner
                "ttft_p90": base["ttft_p90_s"] / cur["ttft_p90_s"],
            }
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default=None, help="speculative scorer (default: the target scores itself)")
    ap.add_argument("--store", default="memory://", help="chunk KV store (directory, redis://, memory://)")
    ap.add_argument("--workload", choices=("demo", "rag"), default="demo",
                    help="demo: each request over its question's sources + random chunks; rag: --requests queries "
                         "over a --corpus chunk corpus (defaults 40, 30, 6 chunks of 120 tokens)")
    ap.add_argument("--requests", type=int, default=None, help="(default: 8; rag: 40)")
    ap.add_argument("--corpus", type=int, default=30, help="rag: chunks in the corpus")
    ap.add_argument("--chunks-per-request", type=int, default=None, help="(default: 4; rag: 6)")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="(default: 200; rag: 120)")
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 where native, else float32), bfloat16, float32")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--methods", nargs="+", default=["full", "speccache"])
    ap.add_argument("--ratio", type=float, default=0.15, help="recompute ratio of the reuse methods")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-blends-per-step", type=int, default=0,
                    help="connector option: blends per engine step (0: all waiting requests at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)

    from ..engine import SpecCacheEngine

    rag = args.workload == "rag"
    requests = args.requests or (40 if rag else 8)
    per_request = args.chunks_per_request or (6 if rag else 4)
    chunk_tokens = args.chunk_tokens or (120 if rag else 200)
    engine = SpecCacheEngine.from_pretrained(args.target, draft=args.draft, store=args.store, backend="vllm",
                                             dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                                             max_model_len=args.max_model_len,
                                             connector_options={"max_blends_per_step": args.max_blends_per_step})
    try:
        if rag:
            texts, prompts = rag_workload(engine.tokenizer, requests, args.corpus, per_request, chunk_tokens, args.seed)
        else:
            texts, prompts = demo_workload(engine.tokenizer, requests, per_request, chunk_tokens, args.seed)
        engine.precompute(texts, progress=True)
        warm = engine.generate_many(prompts[:1], max_new_tokens=2,
                                    reuse=ReuseConfig(method="speccache"))   # loads the draft; not timed
        del warm
        result = run_bench(engine, prompts, args.max_new_tokens, tuple(args.methods), args.ratio, args.rounds)
        from ..prompt import render

        result["prompt_tokens_mean"] = statistics.mean(len(render(p, engine.tokenizer)) for p in prompts)
        result.update(target=args.target, draft=args.draft or args.target, chunks_per_request=per_request,
                      workload=args.workload, corpus=args.corpus if rag else None, dtype=engine.dtype,
                      max_blends_per_step=args.max_blends_per_step)
    finally:
        engine.close()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
