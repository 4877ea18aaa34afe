"""The engine contract every backend keeps (torch, vLLM, remote): one request's validation and its result types.

An engine gives ``precompute(texts) → keys``, ``stream(prompt, …) → GenerationStream`` and the rest from
``Engine``: ``generate`` (a stream read to its end) and ``generate_many``. The checks a request passes are
written here once, so every backend refuses the same bad input with the same words.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .config import SINK_POLICIES, GenerationConfig, OffloadConfig, ReuseConfig
from .kv import check_salt
from .output import GenerationOutput, GenerationStream
from .prompt import RAGPrompt

__all__ = ["Engine", "Request", "GenerationOutput", "GenerationStream", "check_sink", "chunk_texts"]


@dataclass(frozen=True)
class Request:
    """One query, checked: the prompt, how to generate, how to reuse (None: the engine's default)."""

    prompt: RAGPrompt
    gen: GenerationConfig
    reuse: ReuseConfig | None
    offload: OffloadConfig | None
    return_first_logits: bool
    cache_salt: str | None = None           # the tenant: chunks are shared within a salt, never across


def check_sink(sink: str) -> str:
    if sink not in SINK_POLICIES:
        raise ValueError(f"sink must be one of {', '.join(SINK_POLICIES)}, got {sink!r}")
    return sink


def chunk_texts(texts: Iterable[str]) -> list[str]:
    """The texts to precompute, refused if any is empty (a chunk of no tokens has no KV)."""
    texts = list(texts)
    for t in texts:
        if not isinstance(t, str) or not t.strip():
            raise ValueError("cannot precompute an empty chunk")
    return texts


class Engine:
    """The base of every engine. Subclasses set ``context_window`` and ``backend`` and implement ``stream``
    (and ``precompute``); ``offload_note`` is why a backend cannot decode offloaded (None: it can)."""

    backend = "torch"
    offload_note: str | None = None
    context_window: int

    def request(self, prompt, max_new_tokens: int = 64, reuse: ReuseConfig | None = None, temperature: float = 0.0,
                top_p: float = 1.0, stop: Iterable[str] | str | None = None, seed: int | None = None,
                return_first_logits: bool = False, offload: OffloadConfig | str | None = None,
                cache_salt: str | None = None) -> Request:
        """The arguments of ``generate`` / ``stream``, checked the same way on every backend."""
        if not isinstance(prompt, RAGPrompt):
            raise TypeError(f"prompt must be a RAGPrompt, got {type(prompt).__name__}")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        gen = GenerationConfig(max_new_tokens, temperature, top_p, stop, seed)
        if reuse is not None and not isinstance(reuse, ReuseConfig):
            raise TypeError(f"reuse must be a ReuseConfig, got {type(reuse).__name__}")
        offload = OffloadConfig.parse(offload)
        if offload is not None and self.offload_note:
            raise ValueError(self.offload_note)
        return Request(prompt, gen, reuse, offload, return_first_logits, check_salt(cache_salt))

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if prompt_tokens + max_new_tokens > self.context_window:
            raise ValueError(f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceeds the "
                             f"context window of {self.context_window} tokens; retrieve fewer or shorter chunks")

    def check_chunk_fits(self, chunk_tokens: int, sink_tokens: int) -> None:
        """A chunk is prefilled after its sink, with one more token for backends that sample one."""
        if sink_tokens + chunk_tokens + 1 > self.context_window:
            raise ValueError(f"chunk of {chunk_tokens} tokens exceeds the context window of {self.context_window} "
                             "tokens; split it smaller")

    def stream(self, prompt, max_new_tokens: int = 64, reuse: ReuseConfig | None = None, temperature: float = 0.0,
               top_p: float = 1.0, stop: Iterable[str] | str | None = None, seed: int | None = None,
               return_first_logits: bool = False, offload=None, cache_salt: str | None = None) -> GenerationStream:
        raise NotImplementedError

    def generate(self, prompt, max_new_tokens: int = 64, reuse: ReuseConfig | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, stop: Iterable[str] | str | None = None, seed: int | None = None,
                 return_first_logits: bool = False, offload=None, cache_salt: str | None = None) -> GenerationOutput:
        stream = self.stream(prompt, max_new_tokens, reuse, temperature, top_p, stop, seed, return_first_logits,
                             offload=offload, cache_salt=cache_salt)
        for _ in stream:
            pass
        return stream.output

    def generate_many(self, prompts: Iterable[RAGPrompt], max_new_tokens: int = 64,
                      reuse: ReuseConfig | None = None, **kwargs) -> list[GenerationOutput]:
        """``generate`` for each prompt, in order (a backend that batches overrides it)."""
        return [self.generate(p, max_new_tokens, reuse, **kwargs) for p in prompts]

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
