"""What one generation returns, the same for both engines: text, token ids, statistics."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class GenerationStats:
    method: str
    prompt_tokens: int
    dtype: str = ""                 # the target's compute dtype
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    load_s: float = 0.0             # store reads + key rotation
    draft_s: float = 0.0            # choosing what to recompute (draft prefill for speccache)
    draft_forward_s: float = 0.0    # of which the draft model's forward pass
    recompute_s: float = 0.0        # target prefill of the recomputed tokens
    first_decode_s: float = 0.0     # logits → first token

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str = "length"   # "stop" (EOS or stop string) or "length"
    first_logits: torch.Tensor | None = field(default=None, repr=False)


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
