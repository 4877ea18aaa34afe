"""Finding known chunks inside an arbitrary prompt string.

LlamaIndex and LangChain hand an LLM only the final prompt text or chat messages, never the retrieved
chunks. This module finds, by exact content, every chunk the engine knows (precomputed, stored, or
named by a retrieval hint) inside that text, and turns the messages into a :class:`ChatPrompt` whose
chunks ``render`` tokenizes on their own, exactly as they were precomputed. Text that matches no
known chunk stays ordinary prompt text: it is recomputed, never reused by mistake.

Matching is exact (after stripping each chunk's outer whitespace, as LlamaIndex's COMPACT mode does)
and uses the last ``ANCHOR_CHARS`` characters of each chunk as a hash anchor, so one pass over the
prompt checks every known chunk however many there are. Tails, not heads, are anchored because
LlamaIndex prefixes every node of a file with the same metadata lines.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence

from .chat_prompt import ChatPrompt, Part

ANCHOR_CHARS = 32                   # shorter chunks are matched only when a retrieval hint names them


class ChunkTextIndex:
    """The texts of the chunks an engine knows, searchable inside any prompt string.

    Thread-safe. Texts come from ``add`` (precompute, hints seen in prompts) and from ``sync``,
    which reads the texts of store entries not yet seen (``ChunkKV.meta["text"]``).
    """

    def __init__(self):
        self._tails: dict[str, list[str]] = {}      # last ANCHOR_CHARS characters → chunk texts
        self._texts: set[str] = set()
        self._keys: dict[str, list[str]] = {}       # text → store keys (one per model), where known
        self._synced: set[str] = set()              # store keys already read
        self._cursors: dict[int, int | None] = {}   # id(store) → where its journal was read up to
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._texts)

    def __contains__(self, text: str) -> bool:
        return text.strip() in self._texts

    def add(self, texts: Iterable[str], keys: Iterable[str] | None = None) -> None:
        """Remember chunk texts (stripped; shorter than ``ANCHOR_CHARS`` ignored); ``keys``: their
        store keys, one per text, which ``sync`` then need not read."""
        texts = list(texts)
        keys = list(keys) if keys is not None else [None] * len(texts)
        if len(keys) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(keys)} keys")
        with self._lock:
            for text, key in zip(texts, keys):
                text = text.strip() if isinstance(text, str) else ""
                if key is not None:
                    self._synced.add(key)
                    if text and key not in self._keys.setdefault(text, []):
                        self._keys[text].append(key)
                if len(text) >= ANCHOR_CHARS and text not in self._texts:
                    self._texts.add(text)
                    self._tails.setdefault(text[-ANCHOR_CHARS:], []).append(text)

    def keys(self, text: str) -> list[str]:
        """The store keys of a chunk text (one per model that stored it), where precompute or the
        store's text index told them."""
        with self._lock:
            return list(self._keys.get(text.strip(), ()))

    def forget(self, key: str) -> None:
        """Drop a key that turned out not to serve (a server said so); the text stays known."""
        with self._lock:
            for keys in self._keys.values():
                if key in keys:
                    keys.remove(key)

    def sync(self, store) -> int:
        """Learn the texts of store entries added since the last sync (by any process); → how many. The store's
        journal makes this cost what is new, not the size of the store (``KVStore.added_since``)."""
        added, self._cursors[id(store)] = store.added_since(self._cursors.get(id(store)))
        new = [k for k in dict.fromkeys(added) if k not in self._synced]
        found = {k: t for k, t in store.texts(new).items() if t}
        self.add(found.values(), found.keys())
        with self._lock:
            self._synced.update(new)
        return len(found)

    def find(self, text: str, hints: Iterable[str] = ()) -> list[tuple[int, int]]:
        """Non-overlapping ``(start, end)`` character spans of known chunks and of ``hints`` in ``text``,
        left to right; where two candidates overlap the earlier, then the longer, wins.

        A match must not cut a word (the characters around it are not letters or digits where the
        chunk's own edges are). Chunks shorter than ``ANCHOR_CHARS`` (headings, tails of a split)
        are matched only when hinted: retrieval says they are in the prompt.
        """
        extra: dict[str, list[str]] = {}
        short: set[str] = set()
        for h in hints:
            h = h.strip() if isinstance(h, str) else ""
            if len(h) >= ANCHOR_CHARS and h not in self._texts:
                extra.setdefault(h[-ANCHOR_CHARS:], []).append(h)
            elif 0 < len(h) < ANCHOR_CHARS:
                short.add(h)
        found = []
        for end in range(ANCHOR_CHARS, len(text) + 1):
            tail = text[end - ANCHOR_CHARS:end]
            for candidates in (self._tails.get(tail), extra.get(tail)):
                for chunk in candidates or ():
                    start = end - len(chunk)
                    if start >= 0 and text.startswith(chunk, start):
                        found.append((start, end))
        for chunk in short:
            start = text.find(chunk)
            while start >= 0:
                found.append((start, start + len(chunk)))
                start = text.find(chunk, start + 1)
        spans, cursor = [], 0
        for start, end in sorted(found, key=lambda s: (s[0], s[0] - s[1])):
            if start >= cursor and _whole_words(text, start, end):
                spans.append((start, end))
                cursor = end
        return spans


def _whole_words(text: str, start: int, end: int) -> bool:
    """False where the span would split a word: a letter/digit on both sides of either edge."""
    before = start > 0 and text[start - 1].isalnum() and text[start].isalnum()
    after = end < len(text) and text[end].isalnum() and text[end - 1].isalnum()
    return not (before or after)


def split_chunks(content: str, index: ChunkTextIndex, hints: Iterable[str] = (),
                 chunks: list[str] | None = None) -> list[Part]:
    """``content`` as literal text and chunk indices; found chunks are appended to ``chunks``."""
    chunks = [] if chunks is None else chunks
    parts: list[Part] = []
    cursor = 0
    for start, end in index.find(content, hints):
        if start > cursor:
            parts.append(content[cursor:start])
        parts.append(len(chunks))
        chunks.append(content[start:end])
        cursor = end
    if cursor < len(content):
        parts.append(content[cursor:])
    return parts


TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")     # message fields a tool-calling conversation carries


def match_prompt(prompt: str | Sequence[dict], index: ChunkTextIndex, hints: Iterable[str] = ()) -> ChatPrompt:
    """A ``ChatPrompt`` for a completion prompt (one user message) or a list of ``{"role", "content"}``
    messages, with every chunk known to ``index`` or named in ``hints`` marked for reuse."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if not messages:
        raise ValueError("the prompt has no messages")
    hints = list(hints)
    chunks: list[str] = []
    turns = []
    for m in messages:
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise TypeError(f"message content must be text, got {type(content).__name__}")
        turns.append((m["role"], split_chunks(content, index, hints, chunks)))
    question = next((m["content"] for m in reversed(messages) if (m.get("content") or "").strip()), "")
    if not question.strip() and not any(m.get("tool_calls") for m in messages):
        raise ValueError("the prompt is empty: give the model some text")
    extras = [{k: v for k, v in m.items() if k in TOOL_FIELDS} for m in messages]
    return ChatPrompt(chunks=chunks, question=question, turns=turns, extras=extras if any(extras) else [])


_INDEXES: "weakref.WeakKeyDictionary[object, ChunkTextIndex]" = weakref.WeakKeyDictionary()
_INDEXES_LOCK = threading.Lock()


def chunk_index(engine) -> ChunkTextIndex:
    """The ``ChunkTextIndex`` shared by everything that uses ``engine`` (one per engine)."""
    with _INDEXES_LOCK:
        if engine not in _INDEXES:
            _INDEXES[engine] = ChunkTextIndex()
        return _INDEXES[engine]


def prompt_from_text(engine, prompt: str | Sequence[dict], hints: Iterable[str] | None = None) -> ChatPrompt:
    """The ``ChatPrompt`` for a framework's prompt text or messages, ready for ``engine.generate``.

    Without hints the index first learns any chunks stored since it last looked (other processes,
    direct ``engine.precompute`` calls). Hints that occur in the prompt are remembered, so a chunk
    seen once (and then stored by the engine's miss filling) is reused the next time.
    """
    index = chunk_index(engine)
    hints = [h for h in (hints or ()) if isinstance(h, str)]
    if not hints and engine.store is not None:           # a remote engine may have no store of its own
        index.sync(engine.store)
    matched = match_prompt(prompt, index, hints)
    index.add(matched.chunks)
    return matched
