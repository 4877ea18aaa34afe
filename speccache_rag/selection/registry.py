"""Selectors by name: ``ReuseConfig(method=name)`` runs ``SELECTORS[name]``.

A selector blends: given the cache holding the reused chunks, it recomputes what it chooses and
returns ``(last-token logits, positions recomputed)``. Most methods only *choose* positions; they
register with ``@position_selector`` and the recompute is done for them. A new method is one module
that registers itself here under a name declared in ``config.METHOD_TRAITS`` (whether it runs the draft,
whether ``"auto"`` can size its budget); the engine, the CLI and the bench then all know it.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..config import METHODS
from ..runner import KVCache, prefill
from .base import Selection

Blend = Callable[[object, KVCache, Selection, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
SELECTORS: dict[str, Blend] = {}


def _register(name: str, blend: Blend) -> None:
    # config.METHODS is what ReuseConfig accepts: a selector under any other name could never be chosen
    if name not in METHODS or name == "full":
        raise ValueError(f"selector {name!r} is not a reuse method of config.METHOD_TRAITS: declare it there")
    SELECTORS[name] = blend


def blend_selector(name: str):
    """Register ``fn(ops, cache, sel, always) -> (logits, recomputed positions)`` as method ``name``."""
    def register(fn: Blend) -> Blend:
        _register(name, fn)
        return fn
    return register


Pick = Callable[[Selection, object], torch.Tensor]


def recompute_picked(pick: Pick) -> Blend:
    """The blend of a selector that only picks positions: the picked ones and every always-recomputed one
    go through the model."""
    def blend(ops, cache: KVCache, sel: Selection, always: torch.Tensor):
        t = time.perf_counter()
        chosen = pick(sel, ops) if sel.budget else always[:0]
        sel.timings["select_s"] = time.perf_counter() - t
        recomputed = torch.cat([chosen, always]).unique()
        return prefill(ops, cache, sel.tokens.ids[recomputed], recomputed), recomputed
    return blend


def position_selector(name: str):
    """Register ``fn(sel, ops) -> positions`` (among ``sel.reusable``, at most ``sel.budget``) as method
    ``name`` (see ``recompute_picked``)."""
    def register(fn: Pick) -> Pick:
        _register(name, recompute_picked(fn))
        return fn
    return register
