"""What the commands share: user errors, engine loading, documents → chunks, the statistics line, and the
arguments several commands take."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from ..chunking import DEFAULT_CHUNK_TOKENS, MIN_CHUNK_TOKENS, Chunk, chunk_documents, load_documents, token_counter
from ..config import DEFAULT_TARGET, ReuseConfig

DEFAULT_TOP_K = 3
REUSE_DEFAULTS = ReuseConfig()


class UsageError(ValueError):
    """A bad command line; reported as ``error: …`` with exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump, and no SystemExit inside main()
        raise UsageError(f"{message} (see '{self.prog} --help')")


def user_errors() -> tuple[type[BaseException], ...]:
    from ..models import ModelFileError, ModelNotInstalled

    return (ValueError, FileNotFoundError, NotADirectoryError, ModelNotInstalled, ModelFileError)


def err(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def check_common(args: argparse.Namespace) -> None:
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


def load_engine(args: argparse.Namespace, draft: str | None, store):
    """Load the engine (models come from ``speccache_rag.models.load``)."""
    import torch

    from ..engines import open_engine

    t = time.perf_counter()
    engine = open_engine(args.target, draft=draft, store=store, dtype=args.dtype, threads=args.threads,
                         device=args.device)
    pair = args.target if draft in (None, args.target) else f"{args.target} (draft {draft})"
    ls = engine.load_stats
    err(f"loaded {pair} in {time.perf_counter() - t:.1f}s ({engine.dtype}, {torch.get_num_threads()} threads); "
        f"store: {store}")
    err(f"{ls.gate_line()}" + (f"; warm-up {ls.warmup_s:.1f} s" if ls.warmup_s else "")
        + " (one-time, outside every request's TTFT)")
    return engine


def read_documents(paths: Sequence[str], strict: bool):
    """The documents at ``paths`` (before any model loads, so a missing path fails fast); files that are not
    text are skipped with one warning each unless ``strict``."""
    return load_documents(paths, strict=strict, warn=lambda message: err(f"warning: {message}"))


def skipped_note(docs) -> str:
    n = len(docs.skipped)
    return f"; skipped {n} unreadable file{'s' if n != 1 else ''}" if n else ""


def chunk_docs(tokenizer, docs, chunk_tokens: int) -> list[Chunk]:
    chunks = chunk_documents(docs, chunk_tokens, token_counter(tokenizer))
    if not chunks:
        raise ValueError(f"no text found in {', '.join(sorted({d.source for d in docs})) or 'the given paths'}")
    return chunks


def stored(engine, texts: Sequence[str]) -> list[bool]:
    """Whether each chunk's KV is already in the engine's store."""
    from ..kv import chunk_key
    from ..prompt import tokenize_piece

    return [engine.store.contains(chunk_key(engine.fingerprint, tokenize_piece(engine.tokenizer, t)[0]))
            for t in texts]


def precompute_texts(engine, texts: Sequence[str]) -> int:
    """Precompute ``texts`` (with a progress bar); returns how many entries were new."""
    before = stored(engine, texts)
    engine.precompute(texts, progress=True)
    return before.count(False)


def stats_line(stats) -> str:
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


def one_line(text: str) -> str:
    return " ".join(text.split())


# ---- arguments several commands take ------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser, draft: str | None, target: str = DEFAULT_TARGET) -> None:
    p.add_argument("--target", default=target,
                   help="model that answers: a packaged name, an HF directory or a .gguf file "
                        "(default: %(default)s)")
    p.add_argument("--draft", default=draft,
                   help="model that scores which tokens to recompute (default: " + (draft or "the target") + ")")


def add_compute_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="compute dtype; auto = bfloat16 where the CPU/GPU computes it natively (default: auto)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads (default: $SPECCACHE_THREADS, $OMP_NUM_THREADS, or the usable cores)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="where the models compute: cpu, cuda, cuda:1 … (default: CUDA where there is one, else cpu)")


def add_chunk_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, metavar="N",
                   help="target chunk size in tokens; use the same value for precompute and ask "
                        "(default: %(default)s)")


def add_store_arg(p: argparse.ArgumentParser, default: str | None, shown: str = "%(default)s") -> None:
    p.add_argument("--store", default=default, metavar="STORE",
                   help=f"KV store: a directory, memory:// or redis://host:port/db (default: {shown})")


def add_strict_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strict", action="store_true",
                   help="stop at the first file that cannot be read as UTF-8 text (default: skip it, with a warning)")


def _ratio(text: str) -> float | str:
    return "auto" if text == "auto" else float(text)


def add_answer_args(p: argparse.ArgumentParser, max_new_tokens: int, top_k_help: str,
                    ratio: float = REUSE_DEFAULTS.recompute_ratio) -> None:
    p.add_argument("--ratio", type=_ratio, default=ratio,
                   help="share of reused chunk tokens that are recomputed, or 'auto' (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help=f"{top_k_help} (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N", help="(default: %(default)s)")
