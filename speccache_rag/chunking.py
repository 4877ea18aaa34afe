"""Splitting documents into chunks, and a tiny lexical retriever, for the CLI and examples.

Chunks are the unit of KV reuse: a chunk's KV is computed once at ingestion and looked up by its
exact tokens at query time, so the same documents must be chunked the same way both times. Every
function here is deterministic in its inputs (text, ``max_tokens`` and the token counter).
"""
from __future__ import annotations

import logging
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_CHUNK_TOKENS", "MIN_CHUNK_TOKENS", "DOC_SUFFIXES", "Chunk", "Document", "Documents",
           "approx_tokens", "chunk_text", "chunk_documents", "load_documents", "rank_chunks", "token_counter"]

DEFAULT_CHUNK_TOKENS = 256
MIN_CHUNK_TOKENS = 16
DOC_SUFFIXES = (".txt", ".md")

TokenCounter = Callable[[str], int]
logger = logging.getLogger(__name__)

_PARAGRAPH_RE = re.compile(r"\n\s*\n")
_SENTENCE_RE = re.compile(r"(?<=[.!?])\s+")
_WORD_RE = re.compile(r"[0-9a-z]+(?:[.:,][0-9]+)*")     # words, and numbers such as 6:40, 4.20, 6,840
_STOPWORDS = frozenset("""
a about after all also an and any are as at be been before but by can could did do does for from had
has have he her his how i if in into is it its many may me more most much my no not of on one or our
out over she so some such than that the their them then there these they this those to too up was
we were what when where which while who whom whose why will with would you your give name person
""".split())


@dataclass(frozen=True)
class Document:
    source: str            # the file's path, as given or found
    text: str


@dataclass(frozen=True)
class Chunk:
    text: str
    source: str            # the document it came from
    index: int             # its position within that document, from 0

    @property
    def label(self) -> str:
        return f"{os.path.basename(self.source)}#{self.index + 1}"


def approx_tokens(text: str) -> int:
    """A tokenizer-free estimate (about four characters per token for English prose)."""
    return max(1, math.ceil(len(text) / 4)) if text else 0


def token_counter(tokenizer) -> TokenCounter:
    """A counter using ``tokenizer`` (no special tokens), as chunks are tokenized for their KV."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _split_long(unit: str, max_tokens: int, count: TokenCounter) -> list[str]:
    """A paragraph over the budget, cut at sentence ends, then (for one huge sentence) between words."""
    pieces: list[str] = []
    for sentence in _SENTENCE_RE.split(unit):
        if count(sentence) <= max_tokens:
            pieces.append(sentence)
            continue
        words, current = sentence.split(), []
        for word in words:
            if current and count(" ".join(current + [word])) > max_tokens:
                pieces.append(" ".join(current))
                current = []
            current.append(word)
        if current:
            pieces.append(" ".join(current))
    return _pack(pieces, " ", max_tokens, count)


def _pack(units: Sequence[str], sep: str, max_tokens: int, count: TokenCounter, prefix: str = "") -> list[str]:
    """Join consecutive units into pieces of at most ``max_tokens``, balanced in size.

    The number of pieces is what greedy packing needs; each piece is then closed once it reaches the
    average size, so a text of 1.2 budgets becomes two halves rather than a full chunk and a scrap.
    """
    if not units:
        return []
    total = count(sep.join(units))
    target = math.ceil(total / math.ceil(total / max_tokens)) if total > max_tokens else max_tokens
    pieces: list[str] = []
    current: list[str] = []
    for unit in units:
        if current:
            joined = sep.join(current + [unit])
            head = prefix + sep if pieces and prefix else ""
            if count(head + joined) > max_tokens or count(head + sep.join(current)) >= target:
                pieces.append(sep.join(current))
                current = []
        current.append(unit)
    pieces.append(sep.join(current))
    if prefix:
        pieces = [pieces[0]] + [prefix + sep + p for p in pieces[1:]]
    return pieces


def chunk_text(text: str, max_tokens: int = DEFAULT_CHUNK_TOKENS, count: TokenCounter | None = None) -> list[str]:
    """Split ``text`` into chunks of about ``max_tokens`` tokens at paragraph boundaries.

    Paragraphs (separated by blank lines) are packed whole; one longer than the budget is cut at
    sentence ends. A leading Markdown heading (``# Title``) is repeated at the top of every later
    chunk of the same text, so that each chunk says what it is about.
    """
    if max_tokens < MIN_CHUNK_TOKENS:
        raise ValueError(f"chunk size must be at least {MIN_CHUNK_TOKENS} tokens, got {max_tokens}")
    count = count or approx_tokens
    paragraphs = [" ".join(p.split()) for p in _PARAGRAPH_RE.split(text.strip())]
    paragraphs = [p for p in paragraphs if p]
    if not paragraphs:
        return []
    heading = paragraphs[0] if paragraphs[0].startswith("#") and count(paragraphs[0]) <= max_tokens // 4 else ""
    budget = max_tokens - (count(heading) + 1 if heading else 0)
    units: list[str] = []
    for i, p in enumerate(paragraphs):
        units.extend([p] if count(p) <= (max_tokens if i == 0 else budget) else _split_long(p, budget, count))
    return _pack(units, "\n\n", max_tokens, count, prefix=heading)


class Documents(list):
    """``load_documents``' result: the documents read, and ``skipped``: (path, why) of each file passed over."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[tuple[str, str]] = []


def load_documents(paths: Iterable[str | os.PathLike], strict: bool = False,
                   warn: Callable[[str], None] | None = None) -> Documents:
    """The documents at ``paths``: files as given, directories searched (recursively, sorted) for
    ``.txt`` and ``.md`` files, hidden files and folders skipped. Files are read as UTF-8; one that cannot
    be read as text is skipped with one warning (``warn``, default: logged), as LlamaIndex's directory
    reader does, or with ``strict`` stops the load with ``ValueError``. A missing path always raises
    ``FileNotFoundError``."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and p.suffix.lower() in DOC_SUFFIXES
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise FileNotFoundError(f"no {' or '.join(DOC_SUFFIXES)} files under {raw}")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"no such file or directory: {raw}")
    docs = Documents()
    seen: set[Path] = set()
    for f in files:
        if f.resolve() in seen:
            continue
        seen.add(f.resolve())
        try:
            docs.append(Document(str(f), f.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError) as e:
            why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else (e.strerror or type(e).__name__)
            if strict:
                raise ValueError(f"{f} is {why}" if isinstance(e, UnicodeDecodeError) else f"cannot read {f}: {why}"
                                 ) from None
            (warn or logger.warning)(f"skipped {f}: {why}")
            docs.skipped.append((str(f), why))
    return docs


def chunk_documents(docs: Iterable[Document], max_tokens: int = DEFAULT_CHUNK_TOKENS,
                    count: TokenCounter | None = None) -> list[Chunk]:
    """Every document's chunks, in order; identical chunk texts (repeated boilerplate) appear once."""
    chunks: list[Chunk] = []
    seen: set[str] = set()
    for doc in docs:
        for i, text in enumerate(chunk_text(doc.text, max_tokens, count)):
            if text not in seen:
                seen.add(text)
                chunks.append(Chunk(text, doc.source, i))
    return chunks


def _terms(text: str) -> list[str]:
    words = _WORD_RE.findall(text.lower())
    return [w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w
            for w in words if w not in _STOPWORDS]


def rank_chunks(question: str, chunks: Sequence[str], top_k: int = 3) -> list[int]:
    """Indices of the ``top_k`` chunks that best match ``question`` lexically (BM25), best first.

    A dependency-free retriever for demos and tests; chunks sharing no term with the question are
    never returned, so fewer than ``top_k`` may come back.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    docs = [Counter(_terms(c)) for c in chunks]
    if not docs:
        return []
    query = set(_terms(question))
    df = {t: sum(1 for d in docs if t in d) for t in query}
    idf = {t: math.log(1 + (len(docs) - n + 0.5) / (n + 0.5)) for t, n in df.items()}
    avg_len = sum(sum(d.values()) for d in docs) / len(docs) or 1.0
    k1, b = 1.2, 0.75
    scores = []
    for i, d in enumerate(docs):
        norm = k1 * (1 - b + b * sum(d.values()) / avg_len)
        score = sum(idf[t] * d[t] * (k1 + 1) / (d[t] + norm) for t in query if t in d)
        if score > 0:
            scores.append((-score, i))
    return [i for _, i in sorted(scores)[:top_k]]
