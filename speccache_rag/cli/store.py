"""``speccache-rag store stats | verify | gc | export``: operate a KV store (``store.admin`` does the work)."""
from __future__ import annotations

import argparse

from ..config import DEFAULT_STORE
from .common import UsageError, add_store_arg


def add_parser(sub) -> None:
    p = sub.add_parser("store", help="operate a KV store: stats, verify, gc, export",
                       description="stats: entries and bytes per model fingerprint; verify: read every entry "
                                   "(checksum, layout, content address) and name entries of models not given "
                                   "with --model (exit 1 if any fails); gc: evict least recently used entries "
                                   "down to --max-bytes; export: copy every valid entry --to another store.")
    p.add_argument("action", choices=("stats", "verify", "gc", "export"))
    add_store_arg(p, DEFAULT_STORE)
    p.add_argument("--model", action="append", default=[], metavar="M",
                   help="verify: a model whose entries are expected (repeatable); others are reported")
    p.add_argument("--sink", default="bos", help="verify: the sink policy the models' entries were made with")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="verify: the models' compute dtype (part of the fingerprint)")
    p.add_argument("--delete", action="store_true", help="verify: delete the entries that fail")
    p.add_argument("--max-bytes", type=int, default=None, metavar="N", help="gc: the byte budget")
    p.add_argument("--to", default=None, metavar="STORE", help="export: the destination store")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..store import admin, open_store

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
    from ..kv import model_fingerprint
    from ..models import load

    m, tok = load(model, dtype=dtype)
    return model_fingerprint(m, tok, sink)
