"""Waiting on the engine's updates for one HTTP request: all of them for a whole answer, or as a stream of
server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from starlette.requests import Request as HTTPRequest

from generate.serving import openai_api as oa
from generate.serving.answer import Answer, shutting_down, sse
from generate.serving.engine_loop import SHUTDOWN, EngineLoop, Update


class ClientGone(Exception):
    """The client closed its connection before its answer was whole."""


async def wait_all(request: HTTPRequest, queue: asyncio.Queue, count: int) -> list[Update]:
    """Collect updates until ``count`` choices finished; a client that goes away raises ClientGone (looked
    for every 0.25 s, whether or not updates arrive: a running request gets one every step)."""
    finals, looked = [], time.monotonic()
    while len(finals) < count:
        with contextlib.suppress(asyncio.TimeoutError):
            update = await asyncio.wait_for(queue.get(), timeout=0.25)
            finals += [update] if update.finish_reason is not None else []
        if time.monotonic() - looked >= 0.25:
            looked = time.monotonic()
            if await request.is_disconnected():
                raise ClientGone
    return finals


def failure(error: str) -> oa.APIError:
    """The answer to a request the engine ended with ``error``: 503 at shutdown, else 500."""
    if error == SHUTDOWN:
        return shutting_down()
    return oa.APIError(error, status=500, type="server_error", code="generation_failed")


async def stream(answer: Answer, loop: EngineLoop, queue: asyncio.Queue, note: dict) -> AsyncIterator[str]:
    """The answer's server-sent events as the engine's updates arrive, then ``[DONE]``; a stream that stops
    early (the client went away) cancels its requests. At the end it calls ``note["log"]``, if any."""
    finished = 0
    try:
        for chunk in answer.stream_start():
            yield sse(chunk)
        while finished < len(answer.requests):
            update: Update = await queue.get()
            if update.error:
                note["error"] = update.error  # (an error sent in the stream: not a client gone)
                yield sse(failure(update.error).body())
                break
            finished += update.finish_reason is not None
            if update.text or update.finish_reason or (answer.job.logprobs is not None and update.tokens):
                yield sse(answer.chunk(update.index, update.text, update, first=False))
        else:
            if answer.job.include_usage:
                yield sse(answer.head(answer.chunk_kind) | {"choices": [], "usage": answer.usage()})
        yield "data: [DONE]\n\n"
    finally:
        if finished < len(answer.requests):
            loop.cancel(answer.requests)
            if "error" not in note:  # (not a stream that ended in its error)
                note["cancelled"] = True
        note["completion"] = sum(len(r.token_ids) for r in answer.requests)
        note.pop("log", lambda: None)()
