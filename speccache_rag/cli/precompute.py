"""``speccache-rag precompute``: chunk documents and store each chunk's KV, here or on Ray Data."""
from __future__ import annotations

import argparse
import time

from ..config import DEFAULT_STORE, DEFAULT_TARGET
from .common import (add_chunk_args, add_compute_args, add_store_arg, add_strict_arg,
                     chunk_docs, load_engine, precompute_texts, read_documents, skipped_note)


def add_parser(sub) -> None:
    p = sub.add_parser("precompute", help="chunk documents and store their KV caches",
                       description="Chunk .txt/.md files (directories are searched recursively) and precompute "
                                   "each chunk's KV into the store; already stored chunks are skipped.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or directories")
    add_store_arg(p, DEFAULT_STORE)
    p.add_argument("--target", default=DEFAULT_TARGET, help="model whose KV is stored (default: %(default)s)")
    add_compute_args(p)
    add_chunk_args(p)
    add_strict_arg(p)
    p.add_argument("--ray", action="store_true", help="run on Ray Data: one model-holding actor per CPU "
                   "(needs a store every worker reaches: a shared directory or redis://)")
    p.add_argument("--address", default=None, help="--ray: the cluster to join (e.g. 'auto'; default: a local one)")
    p.add_argument("--actors", type=int, default=None, metavar="N", help="--ray: actors (default: one per CPU)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    docs = read_documents(args.paths, args.strict)
    if args.ray:
        return _ray_precompute(args, docs)
    engine = load_engine(args, None, args.store)
    try:
        chunks = chunk_docs(engine.tokenizer, docs, args.chunk_tokens)
        texts = [c.text for c in chunks]
        t = time.perf_counter()
        new = precompute_texts(engine, texts)
        sources = len({c.source for c in chunks})
        print(f"{len(texts)} chunks from {sources} documents: {new} new entries, {len(texts) - new} already "
              f"stored ({time.perf_counter() - t:.1f}s){skipped_note(docs)}; store: {args.store}")
    finally:
        engine.close()
    return 0


def _ray_precompute(args: argparse.Namespace, docs) -> int:
    from ..models import load_tokenizer
    from ..ray_precompute import ray_precompute

    chunks = chunk_docs(load_tokenizer(args.target), docs, args.chunk_tokens)
    summary = ray_precompute([c.text for c in chunks], args.target, str(args.store), dtype=args.dtype,
                             actors=args.actors, address=args.address)
    print(f"{summary.line()} from {len({c.source for c in chunks})} documents{skipped_note(docs)}; "
          f"store: {args.store}")
    return 0 if not summary.failed else 1
