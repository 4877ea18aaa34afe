"""What a SpecCache server's chat completions become on the client: ``GenerationOutput`` with statistics from the
server's report (or its usage block), tool calls in OpenAI's format, from a whole response or a stream."""
from __future__ import annotations

import time

from .output import GenerationOutput, GenerationStats


class Accumulator:
    """A streamed chat completion, gathered into text, tool calls, timing and usage."""

    def __init__(self, method: str, start: float):
        self.method, self.start = method, start
        self.text, self.usage, self.finish, self.ttft = "", None, None, None
        self.calls: dict[int, dict] = {}        # tool calls by index, their arguments arriving in pieces

    def add(self, event) -> str:
        if event.usage is not None:
            self.usage = event.usage
        piece = ""
        for choice in event.choices:
            piece += choice.delta.content or ""
            self.finish = choice.finish_reason or self.finish
            for delta in choice.delta.tool_calls or ():
                call = self.calls.setdefault(delta.index, {"id": None, "type": "function",
                                                           "function": {"name": "", "arguments": ""}})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["function"]["name"] += delta.function.name or ""
                    call["function"]["arguments"] += delta.function.arguments or ""
        if piece and self.ttft is None:
            self.ttft = time.perf_counter() - self.start
        self.text += piece
        return piece

    def output(self) -> GenerationOutput:
        stats = stats_from(self.method, self.usage, {}, self.ttft or 0.0, time.perf_counter() - self.start)
        calls = [self.calls[i] for i in sorted(self.calls)]
        return GenerationOutput(self.text, [], stats, finish_reason(self.finish), usage=plain_usage(self.usage),
                                tool_calls=calls or None)


def plain_usage(usage) -> dict | None:
    return usage.model_dump(exclude_none=True) if usage is not None else None


def finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "tool_calls") else "length"


def stats_from(method: str, usage, report: dict, ttft: float, total: float) -> GenerationStats:
    """Statistics from the server's report where it sent one, else from its usage block."""
    stats = GenerationStats.from_dict(report) if "prompt_tokens" in report else GenerationStats(method, 0)
    stats.method = method
    if usage is not None:
        stats.prompt_tokens, stats.generated_tokens = usage.prompt_tokens, usage.completion_tokens
        details = usage.prompt_tokens_details
        if "prompt_tokens" not in report:
            stats.reused_tokens = int(getattr(details, "cached_tokens", 0) or 0)
            stats.recomputed_tokens = stats.prompt_tokens - stats.reused_tokens
    stats.ttft_s, stats.total_s = ttft, total
    return stats
