"""The correctness gate: an engine reuses KV for a model only once every method, recomputing every token,
has reproduced full prefill on a short built-in prompt.

A model whose implementation the runner gets subtly wrong (an unusual RoPE variant, a patched attention)
would otherwise serve wrong reuse silently. The check runs the first time an engine meets a model
fingerprint — in a private memory store, so the user's store gets no test chunks — and its result is
remembered in the user's store (``put_meta``), so replicas and later processes skip it. If any method
fails, the engine warns and serves full prefill only.
"""
from __future__ import annotations

import copy

import torch

from .config import METHODS, ReuseConfig
from .output import GenerationStats
from .prompt import RAGPrompt, render, tokenize_piece
from .runner import KVCache

GATE_VERSION = 1
CHUNKS = ("The lighthouse on Varrow Point was built in 1887 and its keeper, Odile Marsh, kept a log of every ship.",
          "Varrow Point's ferry leaves twice a day; in winter the afternoon crossing is cancelled when fog sets in.")
QUESTION = "Who kept the log at the lighthouse, and when was it built?"
# Recomputing every position runs full prefill's kernels: the gap is summation order at most. float32 sees
# ~1e-5; bfloat16 keeps 8 mantissa bits, so logits of magnitude ~20 may move by a few 1e-2.
LOGIT_TOL = {torch.float32: dict(atol=1e-3, rtol=1e-4), torch.bfloat16: dict(atol=0.15, rtol=0.02)}
# "reuse" recomputes nothing at any ratio; "full" is the reference.
CHECKED = tuple(m for m in METHODS if m not in ("full", "reuse"))


def meta_name(fingerprint: str) -> str:
    return f"gate-v{GATE_VERSION}-{fingerprint[:48]}"


def failing_methods(blender, tokenizer) -> list[str]:
    """The methods whose r = 1 first-token logits differ from full prefill's on the built-in prompt."""
    from .kv import chunk_key
    from .store import MemoryStore

    probe = copy.copy(blender)                # the engine's blend pipeline, over a private store
    probe.store = MemoryStore()
    for text in CHUNKS:
        ids, _ = tokenize_piece(tokenizer, text)
        probe.store.put(probe.chunk_kv(ids, chunk_key(blender.fingerprint, ids), text))
    prompt = RAGPrompt(chunks=list(CHUNKS), question=QUESTION)
    tokens = render(prompt, tokenizer)

    def first_logits(method: str) -> torch.Tensor:
        stats = GenerationStats(method=method, prompt_tokens=len(tokens))
        reuse = ReuseConfig(method=method, recompute_ratio=1.0)
        return probe.blend(tokens, KVCache.empty(probe.ops, len(tokens)), reuse, stats, prompt=prompt).logits

    full = first_logits("full")
    tol = LOGIT_TOL.get(probe.ops.dtype, LOGIT_TOL[torch.bfloat16])
    failed = []
    for method in CHECKED:
        got = first_logits(method)
        if int(got.argmax()) != int(full.argmax()) or not torch.allclose(got, full, **tol):
            failed.append(method)
    return failed
