"""Choosing the next token, and turning tokens into streamed text that honours stop strings."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None) -> int:
    """logits: [vocab] → token id; temperature 0 is greedy, top_p < 1 keeps the smallest nucleus."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # Keep a token while the mass before it is below top_p, so the nucleus is never empty.
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class StopTextBuffer:
    """Decodes generated tokens incrementally; releases text only once it cannot be the start of a
    stop string or half of a multi-byte character, and cuts the text at the first stop string."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token → (text safe to emit now, whether a stop string was reached)."""
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return self._release(len(self.text)), True
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe -= 1
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    safe = min(safe, len(self.text) - n)
                    break
        return self._release(safe), False

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        piece = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return piece
