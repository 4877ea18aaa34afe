"""Ingestion-time context (FusionRAG, arXiv 2601.12904): a chunk's KV prefilled after its nearest neighbours.

A chunk computed alone never saw the text it will be retrieved with; computed after its nearest neighbours
in the corpus (by the embeddings the framework already made at ingestion), its KV has already read related
text, and there is less for the query-time repair to do. Each such *variant* is stored under a key that
covers the context's tokens; the chunk's plain entry stays. A small JSON index beside the entries
(``store.put_meta``) lists a chunk's variants and the plain keys of their context chunks, so a query picks
the variant whose neighbours it retrieved too.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .prompt import tokenize_piece
from .store import KVStore

CONTEXT_SEPARATOR = "\n\n"      # what joins chunks in a prompt, so a variant reads its context as a prompt would


def context_ids(tokenizer, texts: Sequence[str]) -> list[int]:
    """The tokens a chunk variant is prefilled after: each neighbour, then the separator, as in a prompt."""
    sep, _ = tokenize_piece(tokenizer, CONTEXT_SEPARATOR)
    ids: list[int] = []
    for text in texts:
        ids += tokenize_piece(tokenizer, text)[0] + sep
    return ids


def _index_name(plain_key: str) -> str:
    return f"ctx-{plain_key}"


def variants(store: KVStore, plain_key: str) -> list[dict]:
    """``[{"key": variant key, "context": [plain keys of its context chunks]}, …]``, nearest context first."""
    record = store.get_meta(_index_name(plain_key))
    found = record.get("variants") if isinstance(record, dict) else None
    return [v for v in found or [] if isinstance(v, dict) and isinstance(v.get("key"), str)
            and isinstance(v.get("context"), list)]


def register(store: KVStore, plain_key: str, variant_key: str, context: list[str]) -> None:
    """Add a variant to its chunk's index (idempotent)."""
    known = variants(store, plain_key)
    if all(v["key"] != variant_key for v in known):
        store.put_meta(_index_name(plain_key), {"variants": known + [{"key": variant_key, "context": context}]})


def choose(store: KVStore, plain_key: str, before: list[str], retrieved: set[str], policy: str) -> str | None:
    """The variant key to read for a chunk, or None for the plain entry. ``before``: the plain keys of the
    chunks ahead of it in the prompt; ``retrieved``: those of every chunk in the prompt.

    ``"preceding"``: the variant whose context chunks all come before it in the prompt (what full prefill
    lets it read), the one with most of them; ``"retrieved"``: the variant sharing most context chunks with
    the prompt, wherever they sit, if it shares any; ``"nearest"``: that one, or else the first registered
    (the chunk's nearest neighbours at ingestion); ``"off"``: never a variant."""
    if policy == "off":
        return None
    found = variants(store, plain_key)
    if not found:
        return None
    if policy == "preceding":
        ahead = set(before)
        fits = [v for v in found if set(v["context"]) <= ahead]
        return max(fits, key=lambda v: len(v["context"]))["key"] if fits else None
    if policy == "unseen":
        later = retrieved - set(before)
        fits = [v for v in found if not later.intersection(v["context"]) and set(before).intersection(v["context"])]
        return max(fits, key=lambda v: len(set(before).intersection(v["context"])))["key"] if fits else None
    overlap = [len(retrieved.intersection(v["context"])) for v in found]
    best = max(range(len(found)), key=overlap.__getitem__)
    if overlap[best] or policy == "nearest":
        return found[best]["key"]
    return None


def nearest(embeddings: torch.Tensor | Sequence[Sequence[float]], k: int) -> list[list[int]]:
    """For each row of ``embeddings`` the indices of its ``k`` most cosine-similar other rows, nearest first."""
    e = torch.as_tensor(embeddings, dtype=torch.float32)
    if e.ndim != 2:
        raise ValueError(f"embeddings must be a [n, dim] matrix, got shape {tuple(e.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    k = min(k, e.shape[0] - 1)
    if k <= 0:
        return [[] for _ in range(e.shape[0])]
    e = torch.nn.functional.normalize(e, dim=1)
    sim = e @ e.T
    sim.fill_diagonal_(-float("inf"))
    return sim.topk(k, dim=1).indices.tolist()
