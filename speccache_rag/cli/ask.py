"""``speccache-rag ask``: answer a question from documents, reusing stored chunk KV."""
from __future__ import annotations

import argparse
import sys

from ..chunking import rank_chunks
from ..config import DRAFT_METHODS, METHODS, GenerationConfig, OffloadConfig, ReuseConfig
from ..config import DEFAULT_STORE
from .common import (REUSE_DEFAULTS, UsageError, add_answer_args, add_chunk_args, add_compute_args,
                     add_model_args, add_store_arg, add_strict_arg, chunk_docs, err, load_engine, read_documents,
                     stats_line, stored)


def _offload_bits(text: str) -> int:
    try:
        return OffloadConfig.parse(text).bits
    except (ValueError, AttributeError):
        raise argparse.ArgumentTypeError(f"expected 2bit or 1bit, got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser("ask", help="answer a question from documents, reusing stored chunk KV",
                       description="Chunk the documents as precompute does, pick the top-k chunks by lexical "
                                   "overlap, and answer. The answer goes to stdout, statistics to stderr.")
    p.add_argument("question")
    p.add_argument("--docs", required=True, metavar="PATH", help="file or directory of .txt/.md documents")
    add_store_arg(p, DEFAULT_STORE)
    add_model_args(p, draft=None)
    add_compute_args(p)
    p.add_argument("--method", choices=METHODS, default=REUSE_DEFAULTS.method, help="(default: %(default)s)")
    add_answer_args(p, GenerationConfig().max_new_tokens, "chunks in the prompt")
    p.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    add_strict_arg(p)
    p.add_argument("--offload", type=_offload_bits, default=None, metavar="2bit|1bit",
                   help="decode with SpeCache offloading: a low-bit KV copy resident, top-k rows fetched each step")
    p.add_argument("--offload-topk", type=int, default=OffloadConfig().topk, metavar="K",
                   help="rows fetched per KV head and layer each step (default: %(default)s)")
    add_chunk_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.question.strip():
        raise UsageError("the question is empty")
    reuse = ReuseConfig(method=args.method, recompute_ratio=args.ratio)
    offload = OffloadConfig(bits=args.offload, topk=args.offload_topk) if args.offload else None
    docs = read_documents([args.docs], args.strict)
    # only the draft-scored methods run the draft; don't load one for the others
    engine = load_engine(args, args.draft if args.method in DRAFT_METHODS else None, args.store)
    try:
        from ..prompt import RAGPrompt

        chunks = chunk_docs(engine.tokenizer, docs, args.chunk_tokens)
        picked = [chunks[i] for i in rank_chunks(args.question, [c.text for c in chunks], args.top_k)]
        if not picked:
            err("note: no chunk shares a word with the question; answering without context")
        err("context: " + (", ".join(c.label for c in picked) or "none"))
        if args.method != "full":
            missing = stored(engine, [c.text for c in picked]).count(False)
            if missing:
                err(f"note: {missing} of {len(picked)} chunks are not in the store; they are recomputed this "
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
        err(stats_line(out.stats))
    finally:
        engine.close()
    return 0
