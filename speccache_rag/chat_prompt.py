"""``ChatPrompt``: a framework's chat messages with the chunks found in them marked for reuse."""
from __future__ import annotations

from dataclasses import dataclass, field

from .prompt import RAGPrompt

Part = str | int                    # literal text, or the index of a chunk


@dataclass
class ChatPrompt(RAGPrompt):
    """Chat messages in which chunks were found by content; renders like a ``RAGPrompt``.

    ``turns[i] = (role, parts)``: each part is literal text or the index of a chunk in ``chunks``.
    ``system`` is unused (the system message, if any, is one of the turns); ``question`` holds the
    text of the last turn, for display.
    """

    system: str | None = None
    turns: list[tuple[str, list[Part]]] = field(default_factory=list)
    # per turn, the OpenAI message fields beside role and content (an assistant's tool_calls, a tool result's
    # tool_call_id): a remote server's chat template renders them; a local one has no tools
    extras: list[dict] = field(default_factory=list)

    def messages(self, chunk_texts: list[str]) -> list[dict]:
        extras = self.extras or [{}] * len(self.turns)
        return [{"role": role, "content": "".join(p if isinstance(p, str) else chunk_texts[p] for p in parts), **extra}
                for (role, parts), extra in zip(self.turns, extras)]
