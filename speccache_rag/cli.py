"""``speccache-rag`` command line: ``demo``, ``precompute`` and ``ask``.

Errors a user can fix (unknown model, bad option, missing file) print one ``error: …`` line on
stderr and exit with status 2; set ``SPECCACHE_DEBUG=1`` to get the traceback instead.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence

from .chunking import (DEFAULT_CHUNK_TOKENS, MIN_CHUNK_TOKENS, Chunk, chunk_documents, load_documents, rank_chunks,
                       token_counter)
from .config import DRAFT_METHODS, METHODS, GenerationConfig, OffloadConfig, ReuseConfig

DEFAULT_TARGET = "smollm2-135m"
# The demo pairs a target with a draft ~4x smaller, so that choosing tokens costs less than it saves.
DEMO_TARGET, DEMO_DRAFT = "qwen2.5-coder-0.5b", "smollm2-135m"
# The 0.5B target needs more recompute than the library default (0.15, chosen on the 1.5B target) for
# its two-hop demo questions to come out right.
DEMO_RATIO = 0.5
DEFAULT_STORE = os.path.join(".speccache", "kv")
DEFAULT_TOP_K = 3
DEMO_MAX_NEW_TOKENS = 32
DEMO_ROUNDS = 3                 # TTFT per method and question: the median of this many interleaved runs
_DEFAULTS = ReuseConfig()


class UsageError(ValueError):
    """A bad command line; reported as ``error: …`` with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump, and no SystemExit inside main()
        raise UsageError(f"{message} (see '{self.prog} --help')")


# --------------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------------
def _user_errors() -> tuple[type[BaseException], ...]:
    from .models import ModelFileError, ModelNotInstalled

    return (ValueError, FileNotFoundError, NotADirectoryError, ModelNotInstalled, ModelFileError)


def _err(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def _check_common(args: argparse.Namespace) -> None:
    """Validate numbers before anything slow (model loading) happens."""
    ratio = getattr(args, "ratio", None)
    if ratio is not None and ratio != "auto" and not 0.0 <= ratio <= 1.0:
        raise UsageError(f"--ratio must be within [0, 1] or 'auto', got {ratio:g}")
    if getattr(args, "max_new_tokens", 1) < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if getattr(args, "top_k", 1) < 1:
        raise UsageError(f"--top-k must be >= 1, got {args.top_k}")
    if getattr(args, "chunk_tokens", DEFAULT_CHUNK_TOKENS) < MIN_CHUNK_TOKENS:
        raise UsageError(f"--chunk-tokens must be >= {MIN_CHUNK_TOKENS}, got {args.chunk_tokens}")


def _engine(args: argparse.Namespace, draft: str | None, store):
    """Load the engine (models come from ``speccache_rag.models.load``)."""
    import torch

    from .engine import SpecCacheEngine

    t = time.perf_counter()
    engine = SpecCacheEngine.from_pretrained(target=args.target, draft=draft, store=store, dtype=args.dtype,
                                             threads=args.threads)
    pair = args.target if draft in (None, args.target) else f"{args.target} (draft {draft})"
    ls = engine.load_stats
    _err(f"loaded {pair} in {time.perf_counter() - t:.1f}s ({engine.dtype}, {torch.get_num_threads()} threads); "
         f"store: {store}")
    _err(f"{ls.gate_line()}" + (f"; warm-up {ls.warmup_s:.1f} s" if ls.warmup_s else "")
         + " (one-time, outside every request's TTFT)")
    return engine


def _documents(paths: Sequence[str], strict: bool):
    """The documents at ``paths`` (before any model loads, so a missing path fails fast); files that are not
    text are skipped with one warning each unless ``strict``."""
    return load_documents(paths, strict=strict, warn=lambda message: _err(f"warning: {message}"))


def _skipped_note(docs) -> str:
    n = len(docs.skipped)
    return f"; skipped {n} unreadable file{'s' if n != 1 else ''}" if n else ""


def _chunks(tokenizer, docs, chunk_tokens: int) -> list[Chunk]:
    chunks = chunk_documents(docs, chunk_tokens, token_counter(tokenizer))
    if not chunks:
        raise ValueError(f"no text found in {', '.join(sorted({d.source for d in docs})) or 'the given paths'}")
    return chunks


def _stored(engine, texts: Sequence[str]) -> list[bool]:
    """Whether each chunk's KV is already in the engine's store."""
    from .kv import chunk_key
    from .prompt import tokenize_piece

    return [engine.store.contains(chunk_key(engine.fingerprint, tokenize_piece(engine.tokenizer, t)[0]))
            for t in texts]


def _precompute(engine, texts: Sequence[str]) -> int:
    """Precompute ``texts`` (with a progress bar); returns how many entries were new."""
    before = _stored(engine, texts)
    engine.precompute(texts, progress=True)
    return before.count(False)


def _stats_line(stats) -> str:
    return (f"method={stats.method} ttft={stats.ttft_s:.3f}s total={stats.total_s:.3f}s "
            f"prompt_tokens={stats.prompt_tokens} reused={stats.reused_tokens} "
            f"recomputed={stats.recomputed_tokens} cache_hits={stats.cache_hits} "
            f"cache_misses={stats.cache_misses} generated={stats.generated_tokens}"
            + (_offload_line(stats.offload) if stats.offload else ""))


def _offload_line(o) -> str:
    hits = "" if o.prefetch_hit_rate is None else f" prefetch_hits={o.prefetch_hit_rate:.2f}"
    return (f"\noffload={o.bits}bit topk={o.topk} resident={o.resident_bytes / 2**20:.1f}MiB "
            f"({o.resident_ratio:.3f} of full KV {o.full_kv_bytes / 2**20:.1f}MiB) "
            f"fetched/step={o.fetched_bytes_per_step / 2**10:.0f}KiB{hits} decode={o.decode_tokens_per_s:.1f} tok/s")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _mark(ok: bool) -> str:
    """✓/✗ where stdout can print them, else ASCII."""
    marks = ("✓", "✗")
    try:
        "".join(marks).encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        marks = ("ok", "no")
    return marks[0] if ok else marks[1]


def _matches(answer: str, expected: Sequence[str]) -> bool:
    low = answer.lower()
    return any(e.lower() in low for e in expected if e)


# --------------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------------
def cmd_precompute(args: argparse.Namespace) -> int:
    docs = _documents(args.paths, args.strict)
    if args.ray:
        return _ray_precompute(args, docs)
    engine = _engine(args, None, args.store)
    try:
        chunks = _chunks(engine.tokenizer, docs, args.chunk_tokens)
        texts = [c.text for c in chunks]
        t = time.perf_counter()
        new = _precompute(engine, texts)
        sources = len({c.source for c in chunks})
        print(f"{len(texts)} chunks from {sources} documents: {new} new entries, {len(texts) - new} already "
              f"stored ({time.perf_counter() - t:.1f}s){_skipped_note(docs)}; store: {args.store}")
    finally:
        engine.close()
    return 0


def _ray_precompute(args: argparse.Namespace, docs) -> int:
    from .models import load_tokenizer
    from .ray_precompute import ray_precompute

    chunks = _chunks(load_tokenizer(args.target), docs, args.chunk_tokens)
    summary = ray_precompute([c.text for c in chunks], args.target, str(args.store), dtype=args.dtype,
                             actors=args.actors, address=args.address)
    print(f"{summary.line()} from {len({c.source for c in chunks})} documents{_skipped_note(docs)}; "
          f"store: {args.store}")
    return 0 if not summary.failed else 1


def cmd_ask(args: argparse.Namespace) -> int:
    if not args.question.strip():
        raise UsageError("the question is empty")
    reuse = ReuseConfig(method=args.method, recompute_ratio=args.ratio)
    offload = OffloadConfig(bits=args.offload, topk=args.offload_topk) if args.offload else None
    docs = _documents([args.docs], args.strict)
    # only the draft-scored methods run the draft; don't load one for the others
    engine = _engine(args, args.draft if args.method in DRAFT_METHODS else None, args.store)
    try:
        from .prompt import RAGPrompt

        chunks = _chunks(engine.tokenizer, docs, args.chunk_tokens)
        picked = [chunks[i] for i in rank_chunks(args.question, [c.text for c in chunks], args.top_k)]
        if not picked:
            _err("note: no chunk shares a word with the question; answering without context")
        _err("context: " + (", ".join(c.label for c in picked) or "none"))
        if args.method != "full":
            missing = _stored(engine, [c.text for c in picked]).count(False)
            if missing:
                _err(f"note: {missing} of {len(picked)} chunks are not in the store; they are recomputed this "
                     f"time and stored for next time (run 'speccache-rag precompute' first)")
        prompt = RAGPrompt(chunks=[c.text for c in picked], question=args.question)
        if args.stream:
            stream = engine.stream(prompt, max_new_tokens=args.max_new_tokens, reuse=reuse, offload=offload)
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
            out = stream.output
            sys.stdout.write("\n")
        else:
            out = engine.generate(prompt, max_new_tokens=args.max_new_tokens, reuse=reuse, offload=offload)
            print(out.text.strip())
        sys.stdout.flush()
        _err(_stats_line(out.stats))
    finally:
        engine.close()
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    from .store import admin, open_store

    if args.action == "gc" and args.max_bytes is None:
        raise UsageError("store gc needs --max-bytes N")
    if args.action == "export" and not args.to:
        raise UsageError("store export needs --to STORE")
    store = open_store(args.store)
    try:
        if args.action == "stats":
            s = admin.stats(store)
            print(f"{s['entries']} entries, {s['bytes'] / 2**20:.1f} MiB")
            for fp, m in sorted(s["models"].items(), key=lambda kv: -kv[1]["bytes"]):
                print(f"  model {fp[:16]}: {m['entries']} entries, {m['bytes'] / 2**20:.1f} MiB")
            for t in s.get("tiers", []):
                print(f"  tier {t['tier']}: {t['hits']} hits, {t['misses']} misses")
            return 0
        if args.action == "verify":
            fingerprints = [_fingerprint(m, args.dtype, args.sink) for m in args.model]
            r = admin.verify(store, fingerprints, delete=args.delete)
            for key, why in r.corrupt:
                print(f"corrupt {key}: {why}")
            for key in r.unknown_model:
                print(f"unknown model {key}")
            print(f"{r.checked} entries checked: {len(r.corrupt)} corrupt, {len(r.unknown_model)} of other models"
                  + (f", {r.deleted} deleted" if args.delete else ""))
            return 0 if r.ok else 1
        if args.action == "gc":
            print(f"freed {admin.gc(store, args.max_bytes) / 2**20:.1f} MiB")
            return 0
        dst = open_store(args.to)
        try:
            copied, skipped = admin.export(store, dst)
        finally:
            dst.close()
        print(f"exported {copied} entries to {args.to}" + (f" ({skipped} corrupt skipped)" if skipped else ""))
        return 0
    finally:
        store.close()


def _fingerprint(model: str, dtype: str, sink: str) -> str:
    from .kv import model_fingerprint
    from .models import load

    m, tok = load(model, dtype=dtype)
    return model_fingerprint(m, tok, sink)


def cmd_demo(args: argparse.Namespace) -> int:
    from .bench.metrics import geomean, median
    from .data import demo_dir, demo_questions
    from .prompt import RAGPrompt

    with tempfile.TemporaryDirectory(prefix="speccache-demo-") as tmp:
        store = args.store or os.path.join(tmp, "kv")
        engine = _engine(args, args.draft if args.method in DRAFT_METHODS else None, store)
        try:
            chunks = _chunks(engine.tokenizer, load_documents([demo_dir()], strict=True), args.chunk_tokens)
            print(f"Demo: {len(chunks)} chunks of up to {args.chunk_tokens} tokens from the invented town of "
                  f"Brennock Harbour ({demo_dir()})")
            new = _precompute(engine, [c.text for c in chunks])
            print(f"precomputed: {new} new KV entries, {len(chunks) - new} already stored")
            if args.method in DRAFT_METHODS and args.draft in (None, args.target):
                print("note: the draft is the target itself, so choosing tokens costs a full draft prefill; "
                      "TTFT gains come with a draft smaller than the target")
            print(f"TTFT: from the call to the first token, the median of {DEMO_ROUNDS} interleaved runs per method "
                  "and question; model loading, the gate and warm-up are one-time costs paid above, in no TTFT")

            reuse = ReuseConfig(method=args.method, recompute_ratio=args.ratio)
            name = args.method
            ratios: list[float] = []
            right = {"full": 0, name: 0}
            same = 0
            questions = demo_questions()
            for n, q in enumerate(questions, 1):
                picked = [chunks[i] for i in rank_chunks(q["question"], [c.text for c in chunks], args.top_k)]
                prompt = RAGPrompt(chunks=[c.text for c in picked], question=q["question"])
                print(f"\n[{n}/{len(questions)}] {q['question']}")
                print(f"    expected: {q['answer']}   (from {', '.join(q['sources'])})")
                print(f"    context:  {', '.join(c.label for c in picked)}")
                outs, ttft = {}, {}
                runs = (("full", ReuseConfig(method="full")), (name, reuse))
                for rnd in range(DEMO_ROUNDS):          # interleaved, order alternating: one machine hiccup
                    for label, cfg in (runs if rnd % 2 == 0 else runs[::-1]):   # moves one sample, not a median
                        out = engine.generate(prompt, max_new_tokens=args.max_new_tokens, reuse=cfg)
                        outs.setdefault(label, out)
                        ttft.setdefault(label, []).append(out.stats.ttft_s)
                ttft = {label: median(v) for label, v in ttft.items()}
                for label, _ in runs:
                    out = outs[label]
                    ok = _matches(out.text, [q["answer"], *q.get("aliases", [])])
                    right[label] += ok
                    print(f"    {label:<10} TTFT {ttft[label]:6.3f}s  {_mark(ok)}  {_one_line(out.text)}")
                s = outs[name].stats
                identical = outs[name].text.strip() == outs["full"].text.strip()
                same += identical
                ratios.append(ttft["full"] / max(ttft[name], 1e-9))
                print(f"    TTFT full/{name} = {ratios[-1]:.2f}x; reused {s.reused_tokens} and recomputed "
                      f"{s.recomputed_tokens} of {s.prompt_tokens} prompt tokens; cache hits "
                      f"{s.cache_hits}/{s.cache_hits + s.cache_misses}; same answer as full: "
                      f"{'yes' if identical else 'no'}")
            k = len(questions)
            geo = geomean(ratios)
            print(f"\nSummary over {k} questions ({engine.dtype}): TTFT full/{name} geometric mean {geo:.2f}x "
                  f"(per question {min(ratios):.2f}x to {max(ratios):.2f}x; {sum(r > 1 for r in ratios)}/{k} faster "
                  f"than full); answers containing the expected text: full {right['full']}/{k}, {name} "
                  f"{right[name]}/{k}; identical to full: {same}/{k}")
        finally:
            engine.close()
    return 0


# --------------------------------------------------------------------------------------------------
# parser and entry point
# --------------------------------------------------------------------------------------------------
def _add_model_args(p: argparse.ArgumentParser, draft: str | None, target: str = DEFAULT_TARGET) -> None:
    p.add_argument("--target", default=target,
                   help="model that answers: a packaged name, an HF directory or a .gguf file "
                        "(default: %(default)s)")
    p.add_argument("--draft", default=draft,
                   help="model that scores which tokens to recompute (default: " + (draft or "the target") + ")")


def _add_compute_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="compute dtype; auto = bfloat16 where the CPU/GPU computes it natively (default: auto)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads (default: $SPECCACHE_THREADS, $OMP_NUM_THREADS, or the usable cores)")


def _add_chunk_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, metavar="N",
                   help="target chunk size in tokens; use the same value for precompute and ask "
                        "(default: %(default)s)")


def _add_store_arg(p: argparse.ArgumentParser, default: str | None, shown: str = "%(default)s") -> None:
    p.add_argument("--store", default=default, metavar="STORE",
                   help=f"KV store: a directory, memory:// or redis://host:port/db (default: {shown})")


def _add_strict_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strict", action="store_true",
                   help="stop at the first file that cannot be read as UTF-8 text (default: skip it, with a warning)")


def _ratio(text: str) -> float | str:
    return "auto" if text == "auto" else float(text)


def _offload_bits(text: str) -> int:
    try:
        return OffloadConfig.parse(text).bits
    except (ValueError, AttributeError):
        raise argparse.ArgumentTypeError(f"expected 2bit or 1bit, got {text!r}") from None


def _add_answer_args(p: argparse.ArgumentParser, max_new_tokens: int, top_k_help: str,
                     ratio: float = _DEFAULTS.recompute_ratio) -> None:
    p.add_argument("--ratio", type=_ratio, default=ratio,
                   help="share of reused chunk tokens that are recomputed, or 'auto' (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help=f"{top_k_help} (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N", help="(default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="speccache-rag",
                     description="Faster RAG time-to-first-token: precomputed chunk KV caches, repaired by "
                                 "speculative token selection.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("demo", help="answer questions about the shipped documents, full prefill vs reuse",
                       description="Precompute the shipped demo documents, then answer each demo question with "
                                   "method 'full' and the reuse method, printing answers, TTFT and reuse statistics.")
    _add_model_args(p, draft=DEMO_DRAFT, target=DEMO_TARGET)
    p.add_argument("--method", choices=[m for m in METHODS if m != "full"], default=_DEFAULTS.method,
                   help="reuse method compared with full prefill (default: %(default)s)")
    _add_compute_args(p)
    _add_store_arg(p, None, shown="a temporary directory")
    _add_answer_args(p, DEMO_MAX_NEW_TOKENS, "chunks per question", ratio=DEMO_RATIO)
    _add_chunk_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("precompute", help="chunk documents and store their KV caches",
                       description="Chunk .txt/.md files (directories are searched recursively) and precompute "
                                   "each chunk's KV into the store; already stored chunks are skipped.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or directories")
    _add_store_arg(p, DEFAULT_STORE)
    p.add_argument("--target", default=DEFAULT_TARGET, help="model whose KV is stored (default: %(default)s)")
    _add_compute_args(p)
    _add_chunk_args(p)
    _add_strict_arg(p)
    p.add_argument("--ray", action="store_true", help="run on Ray Data: one model-holding actor per CPU "
                   "(needs a store every worker reaches: a shared directory or redis://)")
    p.add_argument("--address", default=None, help="--ray: the cluster to join (e.g. 'auto'; default: a local one)")
    p.add_argument("--actors", type=int, default=None, metavar="N", help="--ray: actors (default: one per CPU)")
    p.set_defaults(func=cmd_precompute)

    p = sub.add_parser("ask", help="answer a question from documents, reusing stored chunk KV",
                       description="Chunk the documents as precompute does, pick the top-k chunks by lexical "
                                   "overlap, and answer. The answer goes to stdout, statistics to stderr.")
    p.add_argument("question")
    p.add_argument("--docs", required=True, metavar="PATH", help="file or directory of .txt/.md documents")
    _add_store_arg(p, DEFAULT_STORE)
    _add_model_args(p, draft=None)
    _add_compute_args(p)
    p.add_argument("--method", choices=METHODS, default=_DEFAULTS.method, help="(default: %(default)s)")
    _add_answer_args(p, GenerationConfig().max_new_tokens, "chunks in the prompt")
    p.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    _add_strict_arg(p)
    p.add_argument("--offload", type=_offload_bits, default=None, metavar="2bit|1bit",
                   help="decode with SpeCache offloading: a low-bit KV copy resident, top-k rows fetched each step")
    p.add_argument("--offload-topk", type=int, default=OffloadConfig().topk, metavar="K",
                   help="rows fetched per KV head and layer each step (default: %(default)s)")
    _add_chunk_args(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("store", help="operate a KV store: stats, verify, gc, export",
                       description="stats: entries and bytes per model fingerprint; verify: read every entry "
                                   "(checksum, layout, content address) and name entries of models not given "
                                   "with --model (exit 1 if any fails); gc: evict least recently used entries "
                                   "down to --max-bytes; export: copy every valid entry --to another store.")
    p.add_argument("action", choices=("stats", "verify", "gc", "export"))
    _add_store_arg(p, DEFAULT_STORE)
    p.add_argument("--model", action="append", default=[], metavar="M",
                   help="verify: a model whose entries are expected (repeatable); others are reported")
    p.add_argument("--sink", default="bos", help="verify: the sink policy the models' entries were made with")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="verify: the models' compute dtype (part of the fingerprint)")
    p.add_argument("--delete", action="store_true", help="verify: delete the entries that fail")
    p.add_argument("--max-bytes", type=int, default=None, metavar="N", help="gc: the byte budget")
    p.add_argument("--to", default=None, metavar="STORE", help="export: the destination store")
    p.set_defaults(func=cmd_store)

    from .bench.cli import add_arguments as _bench_arguments, run_from_args as _bench_run
    p = sub.add_parser("bench", help="benchmark quality x time to first token across methods (docs/benchmarks.md)",
                       description="Sweep methods and budgets over the same prompts; write results.jsonl, "
                                   "report.md and PNG plots (resumable).")
    _bench_arguments(p)
    p.set_defaults(func=_bench_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 user error, 130 interrupted)."""
    debug = os.environ.get("SPECCACHE_DEBUG", "") not in ("", "0")
    try:
        args = build_parser().parse_args(argv)
        args.command = shlex.join(["speccache-rag", *(sys.argv[1:] if argv is None else argv)])
        _check_common(args)
        return args.func(args)
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except Exception as e:
        if debug or not isinstance(e, _user_errors()):
            raise
        _err(f"error: {_one_line(str(e)) or type(e).__name__}")
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
