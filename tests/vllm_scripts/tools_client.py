"""Tools and structured output through `langchain-speccache` against a real SpecCache `vllm serve` (tool-call
parser on, a model whose chat template has tools). Run in the light venv (no torch).

Usage: python tools_client.py BASE_URL MODEL CHUNK… -- QUESTION → prints a JSON report as its last line.
"""
import json
import sys

if __name__ == "__main__":
    url, model, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    cut = rest.index("--")
    chunks, question = rest[:cut], rest[cut + 1]

    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    from langchain_speccache import ChatSpecCache

    @tool
    def ferry_timetable(stop: str) -> str:
        """Departure times of the ferry at a stop."""
        return "6:40 and 18:10"

    class Answer(BaseModel):
        """The answer to the question."""
        answer: str = Field(description="a few words")

    llm = ChatSpecCache(base_url=url, model=model, max_tokens=48, temperature=0)
    llm.precompute(chunks)
    messages = [SystemMessage("Answer the question using the context. Be brief."),
                HumanMessage("Context:\n" + "\n\n".join(chunks) + "\n\nQuestion: " + question)]
    report = {}
    bound = llm.bind_tools([ferry_timetable], tool_choice="ferry_timetable")
    call = bound.invoke(messages)
    report["tool_call"] = {"names": [c["name"] for c in call.tool_calls], "args": [c["args"] for c in call.tool_calls],
                           "cache_read": call.usage_metadata["input_token_details"]["cache_read"]}
    streamed = None
    for piece in bound.stream(messages):
        streamed = piece if streamed is None else streamed + piece
    report["streamed_names"] = [c["name"] for c in streamed.tool_calls]
    follow = llm.bind_tools([ferry_timetable]).invoke(
        messages + [call, ToolMessage("6:40 and 18:10", tool_call_id=call.tool_calls[0]["id"])])
    report["after_tool"] = {"text": follow.content, "calls": len(follow.tool_calls)}
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Answer, method=method).invoke(messages)
        report[method] = out.answer if isinstance(out, Answer) else repr(out)

    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.speccache import SpecCacheLLM

    def timetable(stop: str) -> str:
        """Departure times of the ferry at a stop."""
        return "6:40 and 18:10"

    li = SpecCacheLLM(api_base=url, model=model, max_new_tokens=48, temperature=0.0)
    history = [ChatMessage(role="system", content=messages[0].content)]
    response = li.chat_with_tools([FunctionTool.from_defaults(timetable)], user_msg=messages[1].content,
                                  chat_history=history, tool_required=True)
    report["llama_index"] = {"function_calling": li.metadata.is_function_calling_model,
                             "names": [c.tool_name for c in li.get_tool_calls_from_response(response)],
                             "cached": li.last_stats.reused_tokens}
    try:
        ChatSpecCache(model=model).bind_tools([ferry_timetable])
        report["local_refused"] = False
    except ValueError as e:
        report["local_refused"] = "vLLM server" in str(e)
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
    report["heavy"] = heavy
    print(json.dumps(report), flush=True)
