"""The SpecCache wire protocol: what rides in ``kv_transfer_params["speccache"]``, built and read here only.

Three requests, from the in-process vLLM engine (``vllm/engine.py``) or any client (``remote.py``), to the
connector (``vllm/connector.py``):

* a **query** — ``{"tag", "method"?, "recompute_ratio"?, "reuse"?: {ReuseConfig fields},`` and where its chunks
  are: ``"spans": [[start, end], …]`` (token positions, with ``"prompt"``: the RAGPrompt for draft scoring),
  or ``"chunks": [store keys]`` that the server places by content, or neither (the server looks them up)};
* a **precompute** — ``{"op": "precompute", "span": [start, end], "tag"}``: the prompt is ``sink + chunk + one
  token``, and the chunk's KV is stored;
* an **info** — ``{"op": "info", "keys": [...]}``: the server's fingerprint, sink tokens, defaults and which
  of ``keys`` it stores.

The answer (a response's ``kv_transfer_params``) is a **report**: the blend's ``GenerationStats`` fields,
``ignored`` chunk keys with reasons, or the info. In-process readers get the worker's report through
``REPORTS`` by tag, since it may reach the scheduler after the request has finished.
"""
from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass

from .config import ReuseConfig
from .prompt import RAGPrompt

# OpenAI request fields a client hands to the server as they are (``RemoteEngine.generate(..., openai_params=)``); vLLM
# serves them (tools need `vllm serve --enable-auto-tool-choice --tool-call-parser …`)
OPENAI_PARAMS = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "frequency_penalty",
                 "presence_penalty")

PARAMS_KEY = "speccache"


def new_tag() -> str:
    return uuid.uuid4().hex


def wrap(params: dict) -> dict:
    """``params`` as a request's ``kv_transfer_params``."""
    return {"kv_transfer_params": {PARAMS_KEY: params}}


def query(reuse: ReuseConfig | None, tag: str, spans: list[list[int]] | None = None,
          prompt: RAGPrompt | None = None, chunks: list[str] | None = None) -> dict:
    """A query's parameters; ``reuse=None`` leaves method and ratio to the server's defaults."""
    params: dict = {"tag": tag}
    if reuse is not None:
        fields = asdict(reuse)
        params.update(method=fields.pop("method"), recompute_ratio=fields.pop("recompute_ratio"), reuse=fields)
    if spans is not None:
        params["spans"] = [[int(s), int(e)] for s, e in spans]
    if prompt is not None:
        params["prompt"] = {"system": prompt.system, "chunks": list(prompt.chunks), "question": prompt.question}
    if chunks:
        params["chunks"] = list(chunks)
    return params


def precompute(start: int, end: int, tag: str) -> dict:
    return {"op": "precompute", "span": [start, end], "tag": tag}


def info(keys: list[str]) -> dict:
    return {"op": "info", "keys": list(keys)}


def read(kv_transfer_params: dict | None) -> dict:
    """The SpecCache parameters (or report) inside a request's (or response's) ``kv_transfer_params``."""
    found = (kv_transfer_params or {}).get(PARAMS_KEY)
    return found if found is not None else {}


@dataclass
class Query:
    """A request's parameters as the connector reads them (``parse``)."""

    op: str                               # "query", "precompute" or "info"
    tag: str | None = None
    method: str | None = None             # None: the deployment's default
    recompute_ratio: float | str | None = None
    reuse: dict | None = None             # ReuseConfig fields beyond method and ratio
    spans: list[list[int]] | None = None
    chunks: list[str] | None = None
    prompt: RAGPrompt | None = None
    keys: list[str] | None = None         # info


def parse(params, n_tokens: int) -> Query:
    """Read and check one request's parameters against its prompt of ``n_tokens`` tokens (ValueError if bad)."""
    try:
        return _parse(params, n_tokens)
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed kv_transfer_params[{PARAMS_KEY!r}]: {type(e).__name__}: {e}") from e


def _parse(params, n_tokens: int) -> Query:
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] must be an object")
    op, tag = params.get("op", "query"), params.get("tag")
    if op == "info":
        keys = params.get("keys")
        return Query("info", tag, keys=[k for k in keys if isinstance(k, str)] if isinstance(keys, list) else [])
    if op == "precompute":
        s, e = (int(x) for x in params["span"])
        if not 0 <= s < e <= n_tokens - 1:
            raise ValueError(f"precompute span {[s, e]} outside the prompt's first {n_tokens - 1} tokens")
        return Query("precompute", tag, spans=[[s, e]])
    if op != "query":
        raise ValueError(f"unknown op {op!r}: 'info', 'precompute' or a query")
    reuse = params.get("reuse") or {}
    if not isinstance(reuse, dict):
        raise ValueError("'reuse' must be an object of ReuseConfig fields")
    chunks = params.get("chunks")
    if chunks is not None and (not isinstance(chunks, list) or not all(isinstance(k, str) for k in chunks)):
        raise ValueError("'chunks' must be a list of store keys")
    prompt = params.get("prompt")
    if prompt is not None:
        if not isinstance(prompt, dict):
            raise ValueError("'prompt' must be an object with system, chunks, question")
        prompt = RAGPrompt(**prompt)
    spans = _valid_spans(params["spans"], n_tokens) if "spans" in params else None
    return Query("query", tag, params.get("method"), params.get("recompute_ratio"), reuse, spans, chunks, prompt)


def _valid_spans(spans, n: int) -> list[list[int]]:
    out, prev = [], 0
    for span in spans:
        s, e = (int(x) for x in span)
        if not prev <= s < e <= n:
            raise ValueError(f"chunk spans must be sorted, non-overlapping and inside the prompt; got {spans}")
        out.append([s, e])
        prev = e
    return out


class Reports:
    """The worker's report per request tag, for in-process readers (bounded: a reader that never comes
    does not grow it)."""

    def __init__(self, limit: int = 4096):
        self._items: OrderedDict[str, dict] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def publish(self, tag: str, report: dict) -> None:
        with self._lock:
            self._items[tag] = report
            while len(self._items) > self._limit:
                self._items.popitem(last=False)

    def pop(self, tag: str) -> dict | None:
        with self._lock:
            return self._items.pop(tag, None)


REPORTS = Reports()
