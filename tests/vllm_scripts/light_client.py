"""The light install against a real SpecCache `vllm serve`: run in a fresh venv holding only
`pip install ./integrations/langchain-speccache ./integrations/llama-index-llms-speccache` (and their
dependencies) — no torch, no transformers.

Usage: python light_client.py BASE_URL CHUNK… -- QUESTION → prints {"langchain": cached, "llama_index": cached,
"heavy": [modules of the model stack that got imported]} as its last line.
"""
import json
import sys

if __name__ == "__main__":
    url, rest = sys.argv[1], sys.argv[2:]
    cut = rest.index("--")
    chunks, question = rest[:cut], rest[cut + 1]

    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_speccache import ChatSpecCache

    llm = ChatSpecCache(base_url=url, model="smollm2", max_tokens=8)
    prompt = ChatPromptTemplate.from_messages([("system", "Answer the question using the context. Be brief."),
                                               ("user", "Context:\n{context}\n\nQuestion: {question}")])
    retriever = RunnableLambda(lambda q: "\n\n".join(chunks))          # the passages a retriever would return
    seen = {}
    chain = {"context": retriever, "question": RunnablePassthrough()} | prompt | llm | RunnableLambda(
        lambda msg: seen.setdefault("msg", msg)) | StrOutputParser()
    answer = chain.invoke(question)
    lc_cached = seen["msg"].usage_metadata["input_token_details"]["cache_read"]

    from llama_index.core import Document, SummaryIndex
    from llama_index.llms.speccache import SpecCacheLLM

    li = SpecCacheLLM(api_base=url, model="smollm2", max_new_tokens=8)
    engine = SummaryIndex.from_documents([Document(text=c) for c in chunks]).as_query_engine(llm=li)
    response = engine.query(question)
    li_cached = li.last_stats.reused_tokens
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "gguf", "safetensors"))
    print(json.dumps({"langchain": lc_cached, "answer": answer, "llama_index": li_cached,
                      "llama_index_text": str(response), "heavy": heavy}), flush=True)
