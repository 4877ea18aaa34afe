"""Data shipped with the package.

``demo/`` holds a small document set written for this project: Brennock Harbour, Tallis Isle and
every person, date and number in it are invented, so that the questions in ``demo/questions.json``
can only be answered from the documents, never from a model's memory. Two of the four questions
need facts from two different documents. ``speccache-rag demo`` runs on it.
"""
from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

__all__ = ["demo_dir", "demo_documents", "demo_questions"]

_DEMO_SUFFIXES = (".md", ".txt")


def demo_dir() -> Path:
    """The directory of the demo documents (a real directory for any ordinary install)."""
    return Path(str(files(__name__).joinpath("demo")))


def demo_documents() -> list[tuple[str, str]]:
    """``[(file name, text), …]`` of the demo documents, in file-name order."""
    root = files(__name__).joinpath("demo")
    docs = [(p.name, p.read_text(encoding="utf-8")) for p in root.iterdir()
            if p.is_file() and p.name.endswith(_DEMO_SUFFIXES)]
    return sorted(docs)


def demo_questions() -> list[dict]:
    """``[{"question", "answer", "aliases", "sources"}, …]`` for the demo documents."""
    text = files(__name__).joinpath("demo", "questions.json").read_text(encoding="utf-8")
    return json.loads(text)
