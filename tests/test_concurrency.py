"""Results belong to the call: many threads, interleaved streams and abandoned streams on one engine."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from speccache_rag import RAGPrompt, ReuseConfig, SpecCacheEngine
from speccache_rag.config import METHODS
from speccache_rag.kv import chunk_key
from speccache_rag.prompt import tokenize_piece

CHUNKS = [
    "Zorblat Industries was founded in 1987 by Mira Quell in the town of Vessendorf.",
    "Mira Quell was born in 1950 in Ostrava and studied metallurgy before moving to Vessendorf.",
    "Vessendorf is a small town on the river Lenne, known for its annual kettle festival in August.",
    "The Lenne rises in the hills north of Vessendorf and joins a larger river after sixty kilometres.",
]
QUESTIONS = ["In which year was the founder of Zorblat Industries born?", "Which river flows through Vessendorf?",
             "When is the kettle festival held?", "Who founded Zorblat Industries?"]


@pytest.fixture(scope="module")
def engine(smollm2):
    model, tok = smollm2
    eng = SpecCacheEngine(model, tok, store="memory://")
    eng.precompute(CHUNKS)
    return eng


def _jobs():
    """Mixed prompts (chunk subsets and orders) × every method."""
    jobs = []
    for i, method in enumerate(METHODS):
        chunks = [CHUNKS[(i + j) % 4] for j in range(2 + i % 3)]
        jobs.append((RAGPrompt(chunks=chunks, question=QUESTIONS[i % 4]), ReuseConfig(method=method)))
    return jobs


def test_eight_threads_each_get_their_own_answer(engine):
    jobs = _jobs()
    alone = [engine.generate(p, max_new_tokens=8, reuse=r) for p, r in jobs]
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(lambda job: engine.generate(job[0], max_new_tokens=8, reuse=job[1]), jobs * 2))
    for i, out in enumerate(together):
        ref = alone[i % len(jobs)]
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert out.stats.method == ref.stats.method and out.stats.prompt_tokens == ref.stats.prompt_tokens
        assert out.stats.recomputed_tokens == ref.stats.recomputed_tokens


def test_two_streams_interleaved_in_one_thread(engine):
    (p1, r1), (p2, r2) = _jobs()[4], _jobs()[1]
    ref1 = engine.generate(p1, max_new_tokens=10, reuse=r1)
    ref2 = engine.generate(p2, max_new_tokens=10, reuse=r2)
    s1, s2 = engine.stream(p1, max_new_tokens=10, reuse=r1), engine.stream(p2, max_new_tokens=10, reuse=r2)
    pieces1, pieces2 = [], []
    for a, b in zip(s1, s2):
        pieces1.append(a)
        pieces2.append(b)
    pieces1 += list(s1)
    pieces2 += list(s2)
    assert "".join(pieces1) == ref1.text == s1.output.text and s1.output.token_ids == ref1.token_ids
    assert "".join(pieces2) == ref2.text == s2.output.text and s2.output.token_ids == ref2.token_ids
    assert s1.output.stats.method == "speccache" and s2.output.stats.method == "reuse"


def test_an_abandoned_stream_still_stores_its_missed_chunks(smollm2):
    model, tok = smollm2
    eng = SpecCacheEngine(model, tok, store="memory://")
    new = "The Orvelle lighthouse on Tallis Isle was built in 1871 and is kept by Agnes Haskett."
    key = chunk_key(eng.fingerprint, tokenize_piece(tok, new)[0])
    stream = eng.stream(RAGPrompt(chunks=[new], question="When was the lighthouse built?"), max_new_tokens=20)
    assert not eng.store.contains(key)
    first = next(stream)
    assert first
    stream.close()
    assert stream.output is None                  # it never finished
    assert eng.store.contains(key)
    again = eng.generate(RAGPrompt(chunks=[new], question="Who keeps the lighthouse?"), max_new_tokens=2,
                         reuse=ReuseConfig(method="reuse"))
    assert again.stats.cache_hits == 1 and again.stats.cache_misses == 0


def test_generate_many_equals_one_by_one(engine):
    jobs = _jobs()[:3]
    many = engine.generate_many([p for p, _ in jobs], max_new_tokens=6, reuse=ReuseConfig(method="qattn"))
    assert [o.token_ids for o in many] == [engine.generate(p, max_new_tokens=6, reuse=ReuseConfig(method="qattn"))
                                           .token_ids for p, _ in jobs]
