"""One factory for every engine: ``open_engine(target, backend=...)`` → torch, vLLM or remote.

Backends are named here by import path, not imported: the torch engine, the vLLM engine and the remote client
sit above this module, and ``SpecCacheEngine.from_pretrained(backend=...)`` reaches the others through it
without an import arrow running back up (vLLM and the openai client stay optional extras).
"""
from __future__ import annotations

import importlib

from .config import DEFAULT_STORE

# what the in-process engines need and the light install leaves out
LOCAL_DEPS = ("torch", "transformers", "safetensors", "gguf", "accelerate", "numpy")
LOCAL_HINT = ("the in-process engine needs torch and transformers: pip install 'speccache-rag[local]' (or "
              "'langchain-speccache[local]' / 'llama-index-llms-speccache[local]'); a SpecCache vLLM server needs "
              "none of them here (base_url=…)")


def import_local(module: str):
    """Import a module of the in-process engine; a missing model stack is named with the install that adds it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in LOCAL_DEPS:
            raise ImportError(f"{LOCAL_HINT} (missing {e.name})") from e
        raise


BACKENDS = {
    "torch": "speccache_rag.engine:SpecCacheEngine",
    "vllm": "speccache_rag.vllm.engine:VllmSpecCacheEngine",
    "remote": "speccache_rag.remote:RemoteEngine",
}


def engine_class(backend: str) -> type:
    """The engine class a backend name stands for."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    module, _, name = BACKENDS[backend].partition(":")
    return getattr(import_local(module), name)


def open_engine(target: str | None, draft: str | None = None, store=None, backend: str | None = None,
                dtype="auto", threads: int | None = None, base_url: str | None = None, api_key: str | None = None,
                timeout: float = 600.0, max_retries: int = 2, cache_salt: str | None = None, **engine_kwargs):
    """An engine from the arguments every caller has: the CLI, both drop-ins, user code.

    backend: "torch" (default), "vllm" (in-process vLLM) or "remote" (a SpecCache ``vllm serve`` at
    ``base_url``; a ``base_url`` alone implies it). target: a packaged name, an HF directory or a .gguf file —
    for remote, the served model's name (None: the server's first). The remote engine computes nothing
    here: draft, dtype and threads are the server's, and ``store`` (optional) is its shared store, read for
    its chunk-text index. store: a directory, "memory://" or "redis://…" (default ``config.DEFAULT_STORE``
    for the local backends). cache_salt: the remote client's tenant, sent with every request (local engines take
    it per call)."""
    backend = backend or ("remote" if base_url else "torch")
    if backend == "remote":
        if not base_url:
            raise ValueError("backend='remote' needs base_url, e.g. http://localhost:8000/v1")
        return engine_class("remote")(base_url, model=target, api_key=api_key, store=store, timeout=timeout,
                                      max_retries=max_retries, cache_salt=cache_salt)
    if base_url:
        raise ValueError(f"base_url is for backend='remote', not {backend!r}")
    if cache_salt is not None:
        raise ValueError("an in-process engine takes cache_salt per call (precompute / generate / stream)")
    if not target:
        raise ValueError("name a target model: a packaged name (speccache-rag models), an HF directory or a .gguf")
    return engine_class("torch").from_pretrained(target, draft=draft, store=store or DEFAULT_STORE, backend=backend,
                                                 dtype=dtype, threads=threads, **engine_kwargs)
