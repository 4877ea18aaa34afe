"""The correctness gate: an engine reuses KV for a model only once every method, recomputing every token,
has reproduced full prefill on a short built-in prompt.

A model whose implementation the runner gets subtly wrong (an unusual RoPE variant, a patched attention)
would otherwise serve wrong reuse silently. The check runs the first time an engine meets a model
fingerprint — when the engine is built (the vLLM worker: at start-up), never inside a request, in a private
memory store so the user's store gets no test chunks — and its result is remembered in the user's store
(``put_meta``), so replicas and later processes skip it. If any method fails, the engine warns and serves
full prefill only.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import METHODS, ReuseConfig
from .output import GenerationStats
from .prompt import RAGPrompt, render, tokenize_piece
from .runner import KVCache

GATE_VERSION = 2          # 2: bfloat16 compared as distributions (a verdict of 1 may be a false failure)
CHUNKS = ("The lighthouse on Varrow Point was built in 1887 and its keeper, Odile Marsh, kept a log of every ship.",
          "Varrow Point's ferry leaves twice a day; in winter the afternoon crossing is cancelled when fog sets in.")
QUESTION = "Who kept the log at the lighthouse, and when was it built?"
# What "reproduces full prefill" means, by compute dtype. float32: elementwise; recomputing every position
# runs full prefill's kernels, so the gap is summation order at most (~1e-5). bfloat16 keeps 8 mantissa bits:
# a run that is not bitwise full prefill's own (another kernel, alignment or thread split, as on CPUs with
# native bf16) already moves SmolLM2's logits by up to 0.7 and each layer's K/V by 4 % of its largest entry
# (measured: one-ulp noise on the embeddings; KL <= 4e-3 on templated prompts, 2e-2 on raw text), so there
# the first-token distributions (same top-1, KL(full || m) <= 0.03) and each layer's K/V as a whole (<= 10 %
# of its largest entry) are compared. That still catches what the gate is for, a runner that gets a model
# wrong (reuse without recompute: KL 0.09-0.13, 26-68 % of a layer's K/V at r <= 0.9); float32 is exact.
FP32_TOL = dict(atol=1e-3, rtol=1e-4)
BF16_MAX_KL, BF16_KV_REL = 0.03, 0.10
# "reuse" recomputes nothing at any ratio; "full" is the reference.
CHECKED = tuple(m for m in METHODS if m not in ("full", "reuse"))


def meta_name(fingerprint: str, backend: str = "torch") -> str:
    """The store metadata entry of one model's verdict on one engine type (their modules differ)."""
    return f"gate-v{GATE_VERSION}-{backend}-{fingerprint[:40]}"


@dataclass
class Verdict:
    failed: list[str]           # methods that did not reproduce full prefill
    from_store: bool            # read, not checked
    seconds: float

    def warning(self, model: str) -> str:
        return (f"{model}: methods {', '.join(self.failed)} do not reproduce full prefill at recompute_ratio=1 on "
                "the built-in check; serving full prefill only")


def run(blender, tokenizer, backend: str, model: str) -> Verdict:
    """The gate for ``blender``'s model on this engine type, applied to it (``Blender.gate_failed``): the
    verdict its store remembers, else checked now and remembered. A verdict that predates a method is
    checked again. Both engines call this once, when they are built."""
    t = time.perf_counter()
    known = remembered(blender.store, blender.fingerprint, backend)
    failed = known if known is not None else check(blender.store, blender, tokenizer, backend, model)
    blender.gate_failed = failed
    return Verdict(failed, known is not None, time.perf_counter() - t)


def check(store, blender, tokenizer, backend: str, model: str) -> list[str]:
    """Run the gate now and remember its verdict in ``store``; → the failed methods."""
    failed = failing_methods(blender, tokenizer)
    store.put_meta(meta_name(blender.fingerprint, backend),
                   {"failed": failed, "checked": list(CHECKED), "model": model, "backend": backend})
    return failed


def remembered(store, fingerprint: str, backend: str) -> list[str] | None:
    """The failed methods of a verdict ``store`` holds that covers every method today's code checks, else None."""
    known = store.get_meta(meta_name(fingerprint, backend))
    if (known is None or not isinstance(known.get("failed"), list)
            or not set(CHECKED) <= set(known.get("checked", []))):
        return None
    return [str(m) for m in known["failed"]]


def failing_methods(blender, tokenizer) -> list[str]:
    """The methods whose r = 1 first-token logits (or, where the engine has none, KV) differ from full
    prefill's on the built-in prompt."""
    run = probe(blender, tokenizer)
    full_logits, full_cache = run("full", 1.0)
    failed = []
    for method in CHECKED:
        logits, cache = run(method, 1.0)
        if full_logits is not None:
            wrong = logits_mismatch(logits, full_logits, blender.ops.dtype)
        else:   # an engine that samples the last token itself (vLLM): the prompt's whole KV must match
            wrong = kv_mismatch(cache, full_cache, blender.ops.dtype)
        if wrong:
            failed.append(method)
    return failed


def first_token_fidelity(full_logits: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """KL(full ‖ method) of the first-token distributions and whether their top-1 tokens agree."""
    p = torch.log_softmax(full_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    kl = float((p.exp() * (p - q)).sum())
    return {"kl": max(kl, 0.0), "top1": float(int(full_logits.argmax()) == int(logits.argmax()))}


def logits_mismatch(logits: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> str | None:
    """How first-token ``logits`` fail to reproduce full prefill's ``ref``, both from a model computing in
    ``dtype`` (see ``FP32_TOL``), or None."""
    fidelity = first_token_fidelity(ref, logits)
    if not fidelity["top1"]:
        return f"top-1 {int(logits.argmax())} instead of {int(ref.argmax())}"
    if dtype == torch.float32:
        a, b = logits.float(), ref.float()
        if not torch.allclose(a, b, **FP32_TOL):
            return f"logits differ by up to {float((a - b).abs().max()):.2e}"
        return None
    kl = fidelity["kl"]
    return f"KL(full || m) = {kl:.2e} > {BF16_MAX_KL}" if kl > BF16_MAX_KL else None


def kv_mismatch(cache: KVCache, ref: KVCache, dtype: torch.dtype) -> str | None:
    """How a blended prompt's K/V fail to reproduce full prefill's, both from a model computing in ``dtype``
    (see ``FP32_TOL``), or None."""
    for name, a, b in (("K", cache.k, ref.k), ("V", cache.v, ref.v)):
        a, b = a.float(), b.float()
        if dtype == torch.float32:
            if not torch.allclose(a, b, **FP32_TOL):
                return f"{name} differs by up to {float((a - b).abs().max()):.2e}"
            continue
        dims = tuple(range(1, b.ndim))
        rel = float(((a - b).abs().amax(dim=dims) / b.abs().amax(dim=dims).clamp_min(1e-6)).max())
        if rel > BF16_KV_REL:
            return f"{name} differs by {rel:.0%} of a layer's largest entry"
    return None


def probe(blender, tokenizer) -> Callable[[str, float], tuple[torch.Tensor | None, KVCache]]:
    """``run(method, ratio)``: the built-in prompt blended by ``blender``'s pipeline over a private store that
    holds its chunks (the gate's check, and the engine's warm-up)."""
    from .store import MemoryStore

    private = copy.copy(blender)
    private.store, private.gate_failed = MemoryStore(), []      # the methods themselves, whatever the verdict
    for text in CHUNKS:
        private.ensure_stored(tokenize_piece(tokenizer, text)[0], text)
    prompt = RAGPrompt(chunks=list(CHUNKS), question=QUESTION)
    tokens = render(prompt, tokenizer)

    def run(method: str, ratio: float) -> tuple[torch.Tensor | None, KVCache]:
        stats = GenerationStats(method=method, prompt_tokens=len(tokens))
        cache = KVCache.empty(private.ops, len(tokens))
        reuse = ReuseConfig(method=method, recompute_ratio=ratio)
        return private.blend(tokens, cache, reuse, stats, prompt=prompt).logits, cache
    return run
