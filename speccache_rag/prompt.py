"""RAG prompts at token level.

The prompt is rendered through the model's chat template with placeholders where the chunks go,
split at the placeholders, and each piece tokenized on its own: every chunk's tokens are then
exactly the tokens it was precomputed with, whatever the template puts around it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:            # rendering needs no torch (the remote client renders too)
    import torch

_PLACEHOLDER = "\uE000SPECCACHE_CHUNK_{}\uE000"          # private-use code points: never in real text
_PLACEHOLDER_RE = re.compile("\uE000SPECCACHE_CHUNK_(\\d+)\uE000")
DEFAULT_SYSTEM = "Answer the question using the context. Be brief."


@dataclass
class RAGPrompt:
    """A system message, retrieved chunks (each reused as a unit) and a question."""

    system: str | None = DEFAULT_SYSTEM
    chunks: list[str] = field(default_factory=list)
    question: str = ""

    def __post_init__(self):
        if not isinstance(self.question, str) or not self.question.strip():
            raise ValueError("the question is empty: RAGPrompt(question=...) needs text")
        self.chunks = list(self.chunks)
        for i, c in enumerate(self.chunks):
            if not isinstance(c, str) or not c.strip():
                raise ValueError(f"chunk {i} is empty; drop it or give it text")

    def user_message(self, chunk_texts: list[str]) -> str:
        context = "\n\n".join(chunk_texts)
        return f"Context:\n{context}\n\nQuestion: {self.question}" if chunk_texts else self.question

    def messages(self, chunk_texts: list[str]) -> list[dict]:
        """The chat messages, with ``chunk_texts[i]`` where chunk i goes (``render`` passes placeholders)."""
        user = [{"role": "user", "content": self.user_message(chunk_texts)}]
        return [{"role": "system", "content": self.system}, *user] if self.system else user


@dataclass
class Segment:
    """Tokens [start, end) of the prompt; ``chunk`` is the chunk index, or None for template text."""

    start: int
    end: int
    text: str
    chunk: int | None = None
    offsets: list[tuple[int, int]] = field(default_factory=list)   # char span of each token within text


@dataclass
class TokenizedPrompt:
    token_ids: list[int]
    segments: list[Segment]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def ids(self) -> torch.Tensor:
        import torch

        return torch.tensor(self.token_ids, dtype=torch.long, device="cpu")   # host-side: the runner moves it

    def chunk_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.chunk is not None]


def tokenize_piece(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokens of one piece of prompt text and their character offsets; no special tokens added."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def sink_token_ids(tokenizer, sink: str = "bos") -> list[int]:
    """The tokens a chunk is prefilled after when its KV is computed alone (their entries are dropped).

    ``"bos"``: the BOS token, or where the tokenizer has none (Qwen) the template's own first token, which
    plays the sink in real prompts; ``"prefix"``: the whole template up to the first chunk with the default
    system message (APE / FusionRAG: every chunk read behind the prefix prompts share, one sink for all);
    ``"none"``: nothing."""
    if sink == "none":
        return []
    if sink == "prefix":
        tokens = render(RAGPrompt(chunks=["\uE001"], question="?"), tokenizer)
        return tokens.token_ids[: tokens.chunk_segments()[0].start]
    if tokenizer.bos_token_id is not None:
        return [tokenizer.bos_token_id]
    return render(RAGPrompt(question="?"), tokenizer).token_ids[:1]


def render(prompt: RAGPrompt, tokenizer) -> TokenizedPrompt:
    """Render through the chat template and tokenize piece by piece, keeping chunk boundaries."""
    placeholders = [_PLACEHOLDER.format(i) for i in range(len(prompt.chunks))]
    messages = prompt.messages(placeholders)
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n\n".join(m["content"] for m in messages) + "\n\nAnswer:"
    if len(_PLACEHOLDER_RE.findall(text)) != len(placeholders):
        raise ValueError("the chat template altered the chunk placeholders; cannot locate chunks")

    token_ids: list[int] = []
    segments: list[Segment] = []

    def add(piece: str, chunk: int | None) -> None:
        if not piece:
            return
        ids, offsets = tokenize_piece(tokenizer, piece)
        segments.append(Segment(len(token_ids), len(token_ids) + len(ids), piece, chunk, offsets))
        token_ids.extend(ids)

    cursor = 0
    for m in _PLACEHOLDER_RE.finditer(text):
        add(text[cursor:m.start()], None)
        idx = int(m.group(1))
        add(prompt.chunks[idx], idx)
        cursor = m.end()
    add(text[cursor:], None)
    return TokenizedPrompt(token_ids, segments)


def retokenize(tokens: TokenizedPrompt, tokenizer) -> TokenizedPrompt:
    """The same segments read by another tokenizer: every segment's text tokenized on its own, so chunk
    boundaries and character offsets line up (how a draft reads a prompt known only as target tokens)."""
    ids: list[int] = []
    segs: list[Segment] = []
    for seg in tokens.segments:
        piece, off = tokenize_piece(tokenizer, seg.text)
        segs.append(Segment(len(ids), len(ids) + len(piece), seg.text, seg.chunk, off))
        ids.extend(piece)
    return TokenizedPrompt(ids, segs)


def _piece(tokenizer, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """Text of a token run and each token's character span in it."""
    text = tokenizer.decode(ids)
    again, offsets = tokenize_piece(tokenizer, text)
    if again == ids:
        return text, offsets
    offsets, prev = [], 0                                # incremental decode: exact spans for any run
    for j in range(len(ids)):
        end = len(tokenizer.decode(ids[: j + 1]))
        offsets.append((min(prev, end), end))
        prev = end
    return text, offsets


def segments_from_spans(tokenizer, token_ids: list[int], spans: list[tuple[int, int]]) -> TokenizedPrompt:
    """A TokenizedPrompt over arbitrary prompt tokens: ``spans`` are the chunks, the rest template text."""
    segs, cursor = [], 0
    for idx, (s, e) in enumerate(spans):
        if s > cursor:
            text, off = _piece(tokenizer, token_ids[cursor:s])
            segs.append(Segment(cursor, s, text, None, off))
        text, off = _piece(tokenizer, token_ids[s:e])
        segs.append(Segment(s, e, text, idx, off))
        cursor = e
    if cursor < len(token_ids):
        text, off = _piece(tokenizer, token_ids[cursor:])
        segs.append(Segment(cursor, len(token_ids), text, None, off))
    return TokenizedPrompt(list(token_ids), segs)
