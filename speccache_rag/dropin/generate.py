"""Generation from a framework's prompt text or chat messages: the drop-ins' one generation path.

The prompt is matched against the engine's known chunks (``matching.prompt_from_text``), then generated
whole or as pieces as they are decoded; for asyncio, a worker thread whose pieces reach the event loop
one by one — or the engine's own async calls (remote).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence

from ..matching import prompt_from_text
from ..output import GenerationOutput


def generate_text(engine, prompt: str | Sequence[dict], hints: Iterable[str] | None = None,
                  **generate_kwargs) -> GenerationOutput:
    """One whole generation from a prompt string or chat messages (``engine.generate``: for a remote
    engine one non-streamed request, whose response carries every statistic)."""
    return engine.generate(prompt_from_text(engine, prompt, hints), **generate_kwargs)


async def agenerate_text(engine, prompt: str | Sequence[dict], hints: Iterable[str] | None = None,
                         **generate_kwargs) -> GenerationOutput:
    """``generate_text`` for asyncio: the engine's own ``agenerate`` where it has one (remote), else a
    worker thread."""
    if hasattr(engine, "agenerate"):
        return await engine.agenerate(prompt_from_text(engine, prompt, hints), **generate_kwargs)
    return await asyncio.to_thread(generate_text, engine, prompt, hints, **generate_kwargs)


def stream_text(engine, prompt: str | Sequence[dict], hints: Iterable[str] | None = None,
                **generate_kwargs) -> Iterator[str | GenerationOutput]:
    """Generate from a prompt string or chat messages: yields text pieces as they are decoded, then
    this call's ``GenerationOutput``. Calls from many threads run side by side (the engine keeps no
    per-request state). ``generate_kwargs`` are those of ``SpecCacheEngine.stream``."""
    stream = engine.stream(prompt_from_text(engine, prompt, hints), **generate_kwargs)
    try:
        yield from stream
    finally:
        stream.close()
    yield stream.output


async def astream_text(engine, prompt: str | Sequence[dict], hints: Iterable[str] | None = None,
                       **generate_kwargs) -> AsyncIterator[str | GenerationOutput]:
    """``stream_text`` for asyncio: generation runs in a worker thread and each piece is handed to the
    event loop as soon as it is decoded. Closing the iterator early stops generation at the next token.
    An engine with its own ``astream`` (remote) is awaited directly."""
    if hasattr(engine, "astream"):
        async for item in engine.astream(prompt_from_text(engine, prompt, hints), **generate_kwargs):
            yield item
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    done = object()

    def work() -> None:
        pieces = stream_text(engine, prompt, hints, **generate_kwargs)
        try:
            for item in pieces:
                loop.call_soon_threadsafe(queue.put_nowait, item)
                if stop.is_set():
                    break
        except BaseException as e:  # handed to the awaiting side, which re-raises it
            loop.call_soon_threadsafe(queue.put_nowait, (done, e))
            return
        finally:
            pieces.close()
        loop.call_soon_threadsafe(queue.put_nowait, (done, None))

    worker = loop.run_in_executor(None, work)
    try:
        while True:
            item = await queue.get()
            if isinstance(item, tuple) and item and item[0] is done:
                if item[1] is not None:
                    raise item[1]
                return
            yield item
    finally:
        stop.set()
        await asyncio.shield(worker)
