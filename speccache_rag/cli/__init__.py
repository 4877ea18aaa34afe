"""``speccache-rag`` command line: ``demo``, ``precompute``, ``ask``, ``store`` and ``bench``, one module
each (``bench``'s lives in ``speccache_rag.bench.cli``); what they share is in ``common``.

Errors a user can fix (unknown model, bad option, missing file) print one ``error: …`` line on
stderr and exit with status 2; set ``SPECCACHE_DEBUG=1`` to get the traceback instead.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

from . import ask, demo, precompute, store
from .common import Parser, check_common, err, one_line, user_errors


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from ..bench.cli import add_arguments as bench_arguments, run_from_args as bench_run

    parser = Parser(prog="speccache-rag",
                    description="Faster RAG time-to-first-token: precomputed chunk KV caches, repaired by "
                                "speculative token selection.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in (demo, precompute, ask, store):
        command.add_parser(sub)
    p = sub.add_parser("bench", help="benchmark quality x time to first token across methods (docs/benchmarks.md)",
                       description="Sweep methods and budgets over the same prompts; write results.jsonl, "
                                   "report.md and PNG plots (resumable).")
    bench_arguments(p)
    p.set_defaults(func=bench_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 user error, 130 interrupted)."""
    debug = os.environ.get("SPECCACHE_DEBUG", "") not in ("", "0")
    try:
        args = build_parser().parse_args(argv)
        args.command = shlex.join(["speccache-rag", *(sys.argv[1:] if argv is None else argv)])
        check_common(args)
        return args.func(args)
    except KeyboardInterrupt:
        err("interrupted")
        return 130
    except Exception as e:
        if debug or not isinstance(e, user_errors()):
            raise
        err(f"error: {one_line(str(e)) or type(e).__name__}")
        return 2
