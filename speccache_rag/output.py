"""What one generation returns, the same for both engines: text, token ids, statistics."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class OffloadStats:
    """Offloaded decoding (``offload=OffloadConfig(...)``): bytes per tier and how well prefetch guessed."""

    bits: int
    topk: int
    speculative: bool
    steps: int = 0                          # decode steps run over the offloaded cache
    resident_bytes: int = 0                 # on the accelerator: low-bit codes, scales, windows, fetch buffer
    full_kv_bytes: int = 0                  # the same tokens' full-precision K and V
    resident_ratio: float = 0.0
    fetched_bytes_per_step: float = 0.0
    prefetch_hit_rate: float | None = None  # fetched rows ∩ the output token's own top-k (over the mixed cache)
    oracle_hit_rate: float | None = None    # … ∩ its top-k at full precision (OffloadConfig(oracle=True))
    spec_token_hit_rate: float | None = None    # speculative token == the token then decoded
    decode_tokens_per_s: float = 0.0


@dataclass
class GenerationStats:
    method: str
    prompt_tokens: int
    dtype: str = ""                 # the target's compute dtype
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    context_variants: int = 0       # hits read from a variant with ingestion-time context (neighbors.py)
    generated_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    load_s: float = 0.0             # store reads + key rotation
    draft_s: float = 0.0            # choosing what to recompute (draft prefill for speccache)
    draft_forward_s: float = 0.0    # of which the draft model's forward pass
    recompute_s: float = 0.0        # target prefill of the recomputed tokens
    first_decode_s: float = 0.0     # logits → first token
    stored_chunks: int = 0          # missed chunks computed alone and stored for the next prompt
    fill_s: float = 0.0             # time spent computing and storing them
    offload: OffloadStats | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GenerationStats":
        """The inverse of ``to_dict``; keys it does not know are ignored."""
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        if isinstance(kw.get("offload"), dict):
            kw["offload"] = OffloadStats(**kw["offload"])
        return cls(**kw)

    def line(self) -> str:
        """One log line."""
        share = self.recomputed_tokens / max(1, self.prompt_tokens)
        return (f"method={self.method} prompt={self.prompt_tokens} reused={self.reused_tokens} "
                f"recomputed={self.recomputed_tokens} ({share:.1%}) hits={self.cache_hits} misses={self.cache_misses} "
                + (f"variants={self.context_variants} " if self.context_variants else "")
                + f"load={self.load_s:.3f}s draft={self.draft_s:.3f}s recompute={self.recompute_s:.3f}s"
                + (f" stored={self.stored_chunks} fill={self.fill_s:.3f}s" if self.stored_chunks else "")
                + (f" offload={self.offload.bits}bit resident={self.offload.resident_ratio:.3f}x"
                   if self.offload else ""))


@dataclass
class LoadStats:
    """One-time costs an engine pays when it is built, so that no request pays them (``engine.load_stats``)."""

    model_load_s: float = 0.0       # target (and draft) weights, in from_pretrained
    gate_s: float = 0.0             # the correctness gate (gate.py); ~0 when the store already knew the verdict
    gate_methods: int = 0           # methods the verdict covers (0: gate off)
    gate_failed: list[str] = field(default_factory=list)
    gate_from_store: bool = False   # the verdict was read, not checked
    warmup_s: float = 0.0           # first-call kernels and lazy imports, on a throw-away prompt (when no gate ran)

    def gate_line(self) -> str:
        if not self.gate_methods:
            return "correctness gate: off"
        verdict = (f"{self.gate_methods} methods ok" if not self.gate_failed else
                   f"{', '.join(self.gate_failed)} failed of {self.gate_methods} methods; serving full prefill only")
        if self.gate_from_store:
            return f"correctness gate: {verdict} (verdict from the store)"
        return f"correctness gate: {verdict} in {self.gate_s:.1f} s"


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str = "length"   # "stop" (EOS or stop string), "length", or (remote, tools) "tool_calls"
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    usage: dict | None = None       # remote engine: the server's own OpenAI usage block
    tool_calls: list[dict] | None = None    # remote engine with tools: the server's calls, OpenAI's format


class GenerationStream(Iterator[str]):
    """Text pieces of one generation as they are decoded; ``output`` is set once the last piece is out.

    Nothing is computed until the first ``next()``; ``close()`` (or dropping it) stops generation."""

    def __init__(self) -> None:
        self.output: GenerationOutput | None = None
        self._pieces: Iterator[str] = iter(())

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()
