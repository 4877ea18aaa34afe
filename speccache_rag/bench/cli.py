"""Argument parsing for ``speccache-rag bench`` (light: heavy modules load only when a run starts)."""
from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from ..config import SINK_POLICIES
from .suites import SUITES, Suite, get_suite


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _shard(text: str) -> tuple[int, int]:
    k, sep, n = text.partition("/")
    try:
        return int(k), int(n)
    except ValueError:
        raise ValueError(f"--shard wants K/N, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suite", default="quick", choices=sorted([*SUITES, "ttft", "offload"]),
                   help="what to run (default: quick); ttft = the timing suite of every method in each dtype; "
                        "offload = SpeCache offloaded decoding against full-KV decode")
    p.add_argument("--out", default=None, help="results directory (default: bench-results/SUITE)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="continue DIR/results.jsonl, skipping rows already there")
    g.add_argument("--fresh", action="store_true", help="delete DIR/results.jsonl first")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from DIR/results.jsonl")
    p.add_argument("--pairs", default=None,
                   help="TARGET:DRAFT[,TARGET:DRAFT…] instead of the suite's model pairs")
    p.add_argument("--methods", default=None, help="comma-separated methods on every prompt (e.g. full,speccache@0.15)")
    p.add_argument("--ttft-methods", default=None, help="comma-separated timed methods (must include full); '' for none")
    p.add_argument("--per-task", type=int, default=None, help="prompts per task")
    p.add_argument("--chunks", type=int, default=None, help="chunks per prompt")
    p.add_argument("--chunk-tokens", dest="bench_chunk_tokens", type=int, default=None, help="target tokens per chunk")
    p.add_argument("--ttft-prompts", type=int, default=None, help="prompts timed")
    p.add_argument("--reps", type=int, default=None, help="timed rounds per prompt (after the warm-up)")
    p.add_argument("--max-new-tokens", dest="bench_max_new_tokens", type=int, default=None, help="greedy tokens per answer")
    p.add_argument("--sweep-prompts", type=int, default=None, help="prompts that also get the sweep methods")
    p.add_argument("--longbench", default=None, help="a LongBench-format JSONL file instead of synthetic prompts")
    p.add_argument("--dtypes", default=None,
                   help="compute dtype(s): auto, float32, bfloat16; the ttft suite takes a list (default: "
                        "float32,bfloat16), the others one (default: auto)")
    p.add_argument("--ttft-chunks", default=None, help="ttft suite: chunks per timed prompt, a list (default: 8,16)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 avoids OpenMP oversubscription on a shared machine)")
    p.add_argument("--stages", default="quality,ttft",
                   help="quality (scores, fidelity, agreement) and/or ttft (timings); default: both")
    p.add_argument("--shard", default="0/1", metavar="K/N",
                   help="only prompts with index K mod N: N processes with the same --out and --resume split a suite")
    p.add_argument("--skip", type=int, default=0, metavar="N",
                   help="leave out each target's first N prompts (new prompts for a sample an earlier run measured)")
    p.add_argument("--sink", default=None, choices=SINK_POLICIES,
                   help="chunk-KV policy: bos (default), prefix (behind the shared template prefix) or none")
    p.add_argument("--passages", type=int, default=None, metavar="N",
                   help="LongBench suites: the first N passages of each row, one chunk each (0: every passage)")
    p.add_argument("--neighbors", type=int, default=None, metavar="K",
                   help="LongBench suites: also store each chunk's KV prefilled after its K nearest passages of the "
                        "file (all-MiniLM-L6-v2), the FusionRAG variant that ReuseConfig.neighbors reads")
    p.add_argument("--singles", action=argparse.BooleanOptionalAction, default=None,
                   help="with --neighbors K > 1: also a variant after each neighbour alone (precompute(singles=True))")
    p.add_argument("--targets", default=None, help="offload suite: comma-separated target models")
    p.add_argument("--contexts", default=None, help="offload suite: prompt lengths in tokens (default: 4096,8192)")
    p.add_argument("--kv-store", default=None, metavar="STORE",
                   help="keep the prompts' chunk KV here (a directory) and each prompt's full-prefill reference "
                        "under OUT/refs, so a resumed run with new --methods pays for those methods only "
                        "(default: memory, nothing kept)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def suite_from_args(args: argparse.Namespace) -> Suite:
    suite = get_suite(args.suite)
    pairs = _pairs(args.pairs) if args.pairs else None
    ttft = None if args.ttft_methods is None else _csv(args.ttft_methods)
    return suite.replace(
        pairs=pairs, methods=_csv(args.methods) if args.methods else None, ttft_methods=ttft,
        n_per_task=args.per_task, n_chunks=args.chunks, chunk_tokens=args.bench_chunk_tokens,
        ttft_examples=args.ttft_prompts if ttft != [] else 0, ttft_reps=args.reps,
        max_new_tokens=args.bench_max_new_tokens, sweep_examples=args.sweep_prompts, sink=args.sink,
        neighbors=args.neighbors, singles=args.singles, passages=args.passages)


def _pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in _csv(text):
        target, sep, draft = item.partition(":")
        if not sep or not target or not draft:
            raise ValueError(f"--pairs wants TARGET:DRAFT items, got {item!r}")
        pairs.append((target, draft))
    return pairs


def ttft_suite_from_args(args: argparse.Namespace):
    from .ttft import TimingSuite

    changes = {"pairs": _pairs(args.pairs) if args.pairs else None,
               "dtypes": _csv(args.dtypes) if args.dtypes else None,
               "n_chunks": [int(n) for n in _csv(args.ttft_chunks)] if args.ttft_chunks else None,
               "chunk_tokens": args.bench_chunk_tokens, "methods": _csv(args.ttft_methods) if args.ttft_methods else None,
               "reps": args.reps}
    return TimingSuite(**{k: v for k, v in changes.items() if v is not None}).validate()


def offload_suite_from_args(args: argparse.Namespace):
    from .offload import OffloadSuite

    dtypes = _csv(args.dtypes) if args.dtypes else None
    if dtypes and len(dtypes) != 1:
        raise ValueError("--dtypes takes one dtype for the offload suite")
    changes = {"targets": _csv(args.targets) if args.targets else None,
               "contexts": [int(c) for c in _csv(args.contexts)] if args.contexts else None,
               "n_per_task": args.per_task, "max_new_tokens": args.bench_max_new_tokens,
               "dtype": dtypes[0] if dtypes else None}
    return OffloadSuite(**{k: v for k, v in changes.items() if v is not None})


def run_from_args(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .report import write_report
    from .suite_run import run_suite

    out = Path(args.out or f"bench-results/{args.suite}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.suite == "offload":
        from .offload import rewrite_offload_report, run_offload_suite

        path = rewrite_offload_report(out) if args.report_only else run_offload_suite(
            offload_suite_from_args(args), out, resume=args.resume, progress=not args.no_progress,
            command=getattr(args, "command", None))
        print(f"report: {path}")
        return 0
    if args.suite == "ttft":
        from .ttft import run_ttft_suite

        path = run_ttft_suite(ttft_suite_from_args(args), out, progress=not args.no_progress,
                              command=getattr(args, "command", None))
        print(f"report: {path}")
        return 0
    if args.report_only:
        path = write_report(out)
    else:
        suite = suite_from_args(args)
        dtypes = _csv(args.dtypes or "auto")
        if len(dtypes) != 1:
            raise ValueError("--dtypes takes one dtype for this suite (a list only for --suite ttft)")
        from functools import partial

        from ..models import load

        path = run_suite(suite, out, resume=args.resume, fresh=args.fresh, progress=not args.no_progress,
                         loader=partial(load, dtype=dtypes[0]),
                         longbench=args.longbench, stages=tuple(_csv(args.stages)), shard=_shard(args.shard),
                         skip=args.skip, command=getattr(args, "command", None), kv_store=args.kv_store)
    print(f"report: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="speccache-rag bench", description="Quality × time-to-first-token benchmarks.")
    add_arguments(p)
    args = p.parse_args(argv)
    args.command = shlex.join(["speccache-rag", "bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
