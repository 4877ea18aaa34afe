"""Finding known chunks inside a framework's prompt string (speccache_rag.matching), and generating from it
(speccache_rag.dropin)."""
from __future__ import annotations

import asyncio

import pytest

from speccache_rag import ReuseConfig, SpecCacheEngine
from speccache_rag.chat_prompt import ChatPrompt
from speccache_rag.dropin import astream_text, precompute_texts, stream_text
from speccache_rag.matching import ANCHOR_CHARS, ChunkTextIndex, chunk_index, match_prompt, prompt_from_text
from tiny_models import tiny_random_model
from speccache_rag.prompt import render, tokenize_piece
from speccache_rag.store import DiskStore

HARBOUR = "file_path: /docs/harbour.md\n\nBrennock Harbour was founded in 1782 by salt traders from Oxbridge Vale."
FERRY = "file_path: /docs/harbour.md\n\nThe ferry Marisol Dray leaves the Brennock slipway at 6:40 each summer morning."
LIBRARY = "The public library on Quay Square opens at nine and lends tide tables for free."


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model("llama", num_layers=2)


@pytest.fixture
def engine(tiny):
    model, tok = tiny
    return SpecCacheEngine(model, tok, store="memory://")


def test_finds_chunks_sharing_a_metadata_prefix_between_template_text():
    index = ChunkTextIndex()
    index.add([HARBOUR, FERRY, LIBRARY])
    text = f"Context information is below.\n---\n{FERRY}\n\n{HARBOUR}\n---\nQuery: When?\nAnswer: "
    assert [text[a:b] for a, b in index.find(text)] == [FERRY, HARBOUR]


def test_partial_or_word_splitting_occurrences_are_plain_text():
    index = ChunkTextIndex()
    index.add([HARBOUR, LIBRARY])
    assert index.find(f"Context: {HARBOUR[:-1]}") == []                     # truncated by a repacker
    assert index.find(f"Context: x{LIBRARY}") == []                          # would cut the word "xThe"
    assert index.find(f"Context: {LIBRARY}More") == [(9, 9 + len(LIBRARY))]  # "." then "M": no word is cut


def test_short_chunks_are_matched_only_when_hinted():
    heading = "# The Kettlewick Cooperative"
    assert len(heading) < ANCHOR_CHARS
    index = ChunkTextIndex()
    index.add([heading])
    text = f"Context:\n{heading}\n\n{LIBRARY}"
    assert index.find(text) == []
    assert [text[a:b] for a, b in index.find(text, hints=[heading, LIBRARY])] == [heading, LIBRARY]


def test_overlapping_candidates_keep_the_earlier_then_longer():
    index = ChunkTextIndex()
    inner = LIBRARY[: len(LIBRARY) - 20].rstrip()
    index.add([LIBRARY, inner])
    assert index.find(f"A: {LIBRARY}") == [(3, 3 + len(LIBRARY))]


def test_messages_round_trip_and_chunks_tokenize_as_precomputed(tiny):
    _, tok = tiny
    index = ChunkTextIndex()
    index.add([HARBOUR, FERRY])
    messages = [{"role": "system", "content": f"Use this context.\n\n{HARBOUR}"},
                {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": f"{FERRY}\n\nWhen does it leave?"}]
    prompt = match_prompt(messages, index)
    assert isinstance(prompt, ChatPrompt) and prompt.chunks == [HARBOUR, FERRY]
    assert prompt.messages(prompt.chunks) == messages
    tokens = render(prompt, tok)
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "".join(s.text for s in tokens.segments) == expected
    for seg in tokens.chunk_segments():
        assert tokens.token_ids[seg.start:seg.end] == tokenize_piece(tok, prompt.chunks[seg.chunk])[0]


def test_a_completion_prompt_is_one_user_message():
    prompt = match_prompt("just a question", ChunkTextIndex())
    assert prompt.chunks == [] and prompt.messages([]) == [{"role": "user", "content": "just a question"}]
    with pytest.raises(ValueError):
        match_prompt("   ", ChunkTextIndex())


def test_index_learns_stored_texts_from_other_writers(tiny, tmp_path):
    model, tok = tiny
    writer = SpecCacheEngine(model, tok, store=DiskStore(tmp_path))
    key = writer.precompute([LIBRARY])[0]
    assert writer.store.texts([key]) == {key: LIBRARY}                   # header only, for DiskStore
    reader = SpecCacheEngine(model, tok, store=DiskStore(tmp_path))
    prompt = prompt_from_text(reader, f"Context:\n{LIBRARY}\n\nQuestion: When does it open?")
    assert prompt.chunks == [LIBRARY] and LIBRARY in chunk_index(reader)


def test_generation_reuses_found_chunks_and_matches_full_at_ratio_one(engine):
    precompute_texts(engine, [f"  {HARBOUR}\n"])                         # stored stripped
    text = f"Context:\n{HARBOUR}\n\nQuestion: Who founded it?"
    *pieces, out = stream_text(engine, text, max_new_tokens=6, reuse=ReuseConfig(method="reuse"))
    assert "".join(pieces) == out.text
    assert out.stats.cache_hits == 1 and out.stats.reused_tokens > 0
    *_, full = stream_text(engine, text, max_new_tokens=6, reuse=ReuseConfig(method="full"))
    *_, ratio1 = stream_text(engine, text, max_new_tokens=6, reuse=ReuseConfig(recompute_ratio=1.0))
    assert ratio1.token_ids == full.token_ids


def test_async_stream_yields_pieces_and_stops_early(engine):
    async def collect(limit=None):
        got = []
        stream = astream_text(engine, "Tell me a story.", max_new_tokens=8)
        async for item in stream:
            got.append(item)
            if limit and len(got) == limit:
                await stream.aclose()
                break
        return got

    items = asyncio.run(collect())
    assert items[-1].stats.generated_tokens == 8 and "".join(items[:-1]) == items[-1].text
    assert len(asyncio.run(collect(limit=2))) == 2
    *_, out = stream_text(engine, "Tell me a story.", max_new_tokens=2)    # the engine is free again
    assert out.stats.generated_tokens == 2
