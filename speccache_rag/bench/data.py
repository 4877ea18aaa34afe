"""Benchmark data: a seeded RULER-style generator over invented entities, and a LongBench JSONL loader.

Distractor prose is real text that ships with every CPython: the help topics of the Python
Language Reference in the standard library module ``pydoc_data.topics`` (≈ 465 kB of English,
the text ``help("topics")`` shows). Code samples, tables and headings are dropped; only
paragraphs of running prose are kept. The facts the questions need are about invented people,
companies, towns and societies (names built from syllables), so a model cannot answer them from
memory, and they are inserted at sentence boundaries inside the prose.

Tasks (each example's facts sit in different chunks where there is more than one):
- ``needle``    one fact, one chunk: "In which town was <company> founded?"  (+ 2 confuser facts)
- ``bridge``    two hops across two chunks: company → founder, founder → birthplace
                "In which city was the founder of <company> born?"           (+ 1 confuser pair)
- ``aggregate`` three members of a society spread over three chunks: "Who are the members of …?"
                                                                             (+ 1 confuser member)
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

TASKS = ("needle", "bridge", "aggregate")
PROSE_SOURCE = "CPython standard library `pydoc_data.topics` (Python Language Reference help topics)"

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“(])")


@dataclass
class Example:
    """One benchmark prompt: retrieved chunks, a question and its references."""

    id: str
    task: str
    chunks: list[str]
    question: str
    answers: list[str]                       # any one is a correct answer (F1 / EM / ROUGE-L take the max)
    values: list[str] = field(default_factory=list)   # every one must appear (RULER string match)
    metric: str = "f1"                       # the task's headline score: "match", "f1" or "rougeL"
    gold_chunks: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Example":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# ---- prose ---------------------------------------------------------------------------------------
def _prose_paragraphs_from_pydoc() -> list[str]:
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = block.split("\n")
            if any(line.startswith((" ", "\t")) for line in lines):      # code, notes, tables, grammar
                continue
            text = " ".join(line.strip() for line in lines)
            if len(text) < 200 or ">>>" in text or "::=" in text or text.startswith(("-[", "[")):
                continue
            letters = sum(c.isalpha() or c.isspace() for c in text)
            if letters / len(text) < 0.9:                                 # symbol-heavy: not prose
                continue
            paragraphs.append(re.sub(r"\s+", " ", text))
    return paragraphs


_PROSE: list[str] | None = None


def prose_paragraphs() -> list[str]:
    """The distractor corpus: paragraphs of English prose, in a fixed order."""
    global _PROSE
    if _PROSE is None:
        _PROSE = _prose_paragraphs_from_pydoc()
        if len(_PROSE) < 50:
            raise RuntimeError("pydoc_data.topics holds too little prose on this Python build")
    return _PROSE


def prose_fingerprint() -> str:
    """SHA-256 prefix of the prose corpus (it follows the Python version), recorded with every run."""
    h = hashlib.sha256("\n".join(prose_paragraphs()).encode()).hexdigest()[:12]
    return f"py{sys.version_info.major}.{sys.version_info.minor}:{h}"


def _sentences() -> list[str]:
    out = []
    for p in prose_paragraphs():
        out.extend(s.strip() for s in _SENTENCE_END.split(p) if s.strip())
    return out


# ---- invented entities ---------------------------------------------------------------------------
_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kl", "l", "m", "n", "p", "qu", "r", "s", "sk", "t", "tr",
           "v", "vr", "z", "th", "h", "j"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "ia"]
_CODAS = ["", "n", "r", "l", "s", "th", "m", "nd", "rk", "x", "v"]
_TOWN_SUFFIX = ["dorf", "holm", "wick", "mere", "stad", "vale", "port", "by", "ford", "heim"]
_COMPANY_KIND = ["Industries", "Foundry", "Works", "Instruments", "Textiles", "Shipping", "Mills", "Optics"]
_SOCIETY_ADJ = ["Amber", "Silent", "Northern", "Copper", "Violet", "Hollow", "Iron", "Crimson", "Lantern"]
_SOCIETY_NOUN = ["Heron", "Compass", "Orchard", "Beacon", "Quill", "Anchor", "Thistle", "Falcon", "Meridian"]


class _Names:
    """Unique invented names for one example."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def _word(self, syllables: int) -> str:
        r = self.rng
        w = "".join(r.choice(_ONSETS) + r.choice(_VOWELS) for _ in range(syllables)) + r.choice(_CODAS)
        return w.capitalize()

    def _unique(self, make: Callable[[], str]) -> str:
        for _ in range(1000):
            name = make()
            if name not in self.used and not any(name in u or u in name for u in self.used):
                self.used.add(name)
                return name
        raise RuntimeError("ran out of invented names")

    def person(self) -> str:
        return self._unique(lambda: f"{self._word(2)} {self._word(self.rng.choice([2, 3]))}")

    def town(self) -> str:
        return self._unique(lambda: self._word(self.rng.choice([1, 2])) + self.rng.choice(_TOWN_SUFFIX))

    def company(self) -> str:
        return self._unique(lambda: f"{self._word(2)} {self.rng.choice(_COMPANY_KIND)}")

    def society(self) -> str:
        return self._unique(lambda: f"{self.rng.choice(_SOCIETY_ADJ)} {self.rng.choice(_SOCIETY_NOUN)} Society")


# ---- chunks --------------------------------------------------------------------------------------
def approx_tokens(text: str) -> int:
    """A tokenizer-free size estimate (≈ 4 characters per token of English)."""
    return max(1, round(len(text) / 4))


def tokenizer_counter(tokenizer) -> Callable[[str], int]:
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chunk(rng: random.Random, sentences: list[str], chunk_tokens: int, facts: list[str],
           count: Callable[[str], int]) -> str:
    """Consecutive prose sentences from a random place, about chunk_tokens long, facts at random boundaries."""
    budget = chunk_tokens - sum(count(f) + 1 for f in facts)
    start = rng.randrange(len(sentences))
    body: list[str] = []
    size = 0
    i = start
    while size < budget:
        s = sentences[i % len(sentences)]
        n = count(s) + 1
        i += 1
        if n > chunk_tokens // 2:                 # a run-on sentence would dominate the chunk
            continue
        body.append(s)
        size += n
    for fact in facts:
        body.insert(rng.randint(0, len(body)), fact)
    return " ".join(body)


def _place(rng: random.Random, n_chunks: int, k: int) -> list[int]:
    return rng.sample(range(n_chunks), k)


def make_example(task: str, index: int, seed: int = 0, n_chunks: int = 6, chunk_tokens: int = 256,
                 count: Callable[[str], int] = approx_tokens) -> Example:
    """One seeded example of ``task`` (its RNG depends only on task, index and seed)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if n_chunks < 4:
        raise ValueError("need at least 4 chunks (facts and confusers sit in different chunks)")
    rng = random.Random(f"{seed}:{task}:{index}")
    names = _Names(rng)
    facts: dict[int, list[str]] = {i: [] for i in range(n_chunks)}
    if task == "needle":
        company, town = names.company(), names.town()
        slots = _place(rng, n_chunks, 3)
        facts[slots[0]].append(f"{company} was founded in the town of {town}.")
        for s in slots[1:]:
            facts[s].append(f"{names.company()} was founded in the town of {names.town()}.")
        ex = dict(question=f"In which town was {company} founded?", answers=[town], values=[town],
                  metric="match", gold=[slots[0]])
    elif task == "bridge":
        company, person, city = names.company(), names.person(), names.town()
        other_co, other_p, other_city = names.company(), names.person(), names.town()
        slots = _place(rng, n_chunks, 4)
        facts[slots[0]].append(f"{company} was founded by {person}.")
        facts[slots[1]].append(f"{person} was born in the city of {city}.")
        facts[slots[2]].append(f"{other_co} was founded by {other_p}.")
        facts[slots[3]].append(f"{other_p} was born in the city of {other_city}.")
        ex = dict(question=f"In which city was the founder of {company} born?", answers=[city], values=[city],
                  metric="match", gold=slots[:2])
    else:
        society = names.society()
        members = [names.person() for _ in range(3)]
        slots = _place(rng, n_chunks, 4)
        verbs = ["is a member of", "joined", "belongs to"]
        for s, m, v in zip(slots, members, verbs):
            facts[s].append(f"{m} {v} the {society}.")
        other = names.society()
        while other == society:
            other = names.society()
        facts[slots[3]].append(f"{names.person()} is a member of the {other}.")
        ex = dict(question=f"Who are the members of the {society}? Name all three.",
                  answers=[", ".join(members[:-1]) + " and " + members[-1]], values=members,
                  metric="match", gold=slots[:3])
    sentences = _sentences()
    chunks = [_chunk(rng, sentences, chunk_tokens, facts[i], count) for i in range(n_chunks)]
    return Example(id=f"{task}-{seed}-{index}", task=task, chunks=chunks, question=ex["question"],
                   answers=ex["answers"], values=ex["values"], metric=ex["metric"], gold_chunks=sorted(ex["gold"]))


def synthetic(n_per_task: int, seed: int = 0, n_chunks: int = 6, chunk_tokens: int = 256,
              tasks: Iterable[str] = TASKS, count: Callable[[str], int] = approx_tokens) -> list[Example]:
    """``n_per_task`` examples of each task, interleaved task by task (so any prefix is balanced)."""
    tasks = list(tasks)
    return [make_example(t, i, seed, n_chunks, chunk_tokens, count) for i in range(n_per_task) for t in tasks]


# ---- LongBench --------------------------------------------------------------------------------------
_PASSAGE = re.compile(r"Passage\s+\d+\s*:")
ROUGE_DATASETS = ("samsum", "multi_news", "gov_report", "qmsum", "vcsum")


def split_passages(context: str, chunk_tokens: int = 512, count: Callable[[str], int] = approx_tokens) -> list[str]:
    """"Passage N:" sections as chunks; contexts without markers are packed paragraph by paragraph."""
    if _PASSAGE.search(context):
        parts = [p.strip() for p in _PASSAGE.split(context)]
        return [p for p in parts if p]
    chunks, current, size = [], [], 0
    for para in (p.strip() for p in re.split(r"\n\s*\n|\n", context)):
        if not para:
            continue
        n = count(para)
        if current and size + n > chunk_tokens:
            chunks.append("\n".join(current))
            current, size = [], 0
        current.append(para)
        size += n
    if current:
        chunks.append("\n".join(current))
    return chunks


def load_longbench(path: str | Path, limit: int | None = None, chunk_tokens: int = 512,
                   count: Callable[[str], int] = approx_tokens, dataset: str | None = None) -> list[Example]:
    """Read a LongBench-format JSONL file: ``{"context", "input", "answers", ["dataset", "_id"]}`` per line.

    QA sets (2WikiMQA, MuSiQue, HotpotQA, …) are scored by word F1; summaries (SAMSum, MultiNews, …)
    by ROUGE-L. ``dataset`` overrides the name used to choose (default: the row's field, else the file name).
    """
    path = Path(path)
    out = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e.msg})") from None
            missing = [k for k in ("context", "input", "answers") if k not in row]
            if missing:
                raise ValueError(f"{path}:{line_no}: missing field(s) {', '.join(missing)}")
            name = (dataset or row.get("dataset") or path.stem).lower()
            chunks = split_passages(row["context"], chunk_tokens, count)
            answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
            question = row["input"].strip() or "Summarize the passages."
            if not chunks:
                continue
            out.append(Example(id=str(row.get("_id", f"{path.stem}-{line_no}")), task=name, chunks=chunks,
                               question=question, answers=[str(a) for a in answers], values=[],
                               metric="rougeL" if any(d in name for d in ROUGE_DATASETS) else "f1"))
            if limit is not None and len(out) >= limit:
                break
    return out
