"""The server's engine loop: one engine, stepped in the process's main thread, fed and drained from asyncio.

Every torch call of the server runs in one thread, the main one (loading, compiling, steps, prompt
logprobs): torch's OpenMP pool is per calling thread, and a second thread's pool on a small machine makes
libgomp throttle its spinning for all of them. On 2 Zen 4 cores the shipped model's 4-slot step took 13 ms
in the main thread alone and 17-22 ms once a second thread had run torch. The HTTP server (asyncio, in
another thread) hands requests over at any time; they join the engine only between steps. After each step
every request that moved gets an :class:`Update` on its own asyncio queue: its new tokens, their
log-probabilities, the text now settled, and, at the end, why it finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from generate.engine.engine import Engine
from generate.engine.request import Request

log = logging.getLogger("gptgen.server")


class QueueFull(Exception):
    """More requests are waiting for a slot than the server's ``--max-queue`` allows."""


class TooLarge(Exception):
    """An HTTP request has more choices than the queue can ever hold (``--max-queue``)."""


class Stopping(Exception):
    """The server is shutting down: it takes no new requests."""


SHUTDOWN = "the server is shutting down; retry on another server or later"


def _refuse() -> None:
    raise Stopping(SHUTDOWN)


@dataclass
class Update:
    """What one step gave one request (``index`` is its place among its HTTP request's choices)."""

    index: int
    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]
    text: str
    finish_reason: str | None = None  # set on the request's last update
    error: str | None = None


@dataclass
class Metrics:
    """Counters for ``/metrics`` (Prometheus text)."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)  # (endpoint, status) -> count
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cancelled: int = 0
    steps: int = 0
    step_seconds: float = 0.0

    def count(self, endpoint: str, status: int) -> None:
        """Count one answered HTTP request."""
        self.requests[endpoint, status] = self.requests.get((endpoint, status), 0) + 1


@dataclass
class _Sink:
    """Where a request's updates go: an asyncio queue, filled from the engine's thread."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    index: int
    sent: int = 0

    def put(self, update: Update) -> None:
        with contextlib.suppress(RuntimeError):  # the HTTP side has stopped (its loop closed): no one to tell
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)


class EngineLoop:
    """Owns the engine: queues requests, steps while there is work, hands each step's results out.

    :meth:`run` is the loop (call it in the thread that loaded the model); :meth:`submit`, :meth:`cancel`,
    :meth:`call` and :meth:`close` are called from the asyncio thread.

    Args:
        engine: the engine (a request with bad logits, or whose sampling fails, fails alone).
        max_queue: the most requests waiting for a slot; beyond it :meth:`submit` raises :class:`QueueFull`.
    """

    def __init__(self, engine: Engine, max_queue: int) -> None:
        self.engine, self.max_queue = engine, max_queue
        self.metrics = Metrics()
        self._lock = threading.Condition()
        self._incoming: list[tuple[Request, _Sink]] = []
        self._cancels: list[Request] = []
        self._calls: list[tuple[Callable[[], Any], asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._active: dict[int, tuple[Request, _Sink]] = {}  # id(request) -> (request, sink)
        self._closed = False
        self.turns_waiting = 0  # attention requests admitted that wait for a turn: they count in the queue
        self._deadline: float | None = None  # set by stop(): when what still runs is ended

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._incoming) + len(self.engine.waiting)

    @property
    def busy(self) -> int:
        """Slots running a request."""
        return len(self.engine.running)

    def waiting(self, more: int = 0) -> int:
        """Requests that wait for a slot once ``more`` join the queued ones: those the free slots take at the
        next step do not (a burst at an idle server is not a full queue)."""
        return max(0, self.queued + more - (self.engine.slots - self.busy))

    def submit(self, requests: list[Request]) -> asyncio.Queue:
        """Queue an HTTP request's engine requests; their updates arrive on the returned queue.

        Raises:
            TooLarge: if they are more than ``max_queue``: they could never all wait.
            QueueFull: if they would take the waiting queue past ``max_queue`` now.
            Stopping: if the server is shutting down.
        """
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed or self._deadline is not None:
                raise Stopping(SHUTDOWN)
            if len(requests) > self.engine.slots + self.max_queue:  # (the free slots take some at once)
                raise TooLarge(
                    f"the request asks for {len(requests)} completions (prompts x n) but the server takes at "
                    f"most {self.engine.slots + self.max_queue} at once ({self.engine.slots} in its slots, "
                    f"--max-slots, {self.max_queue} queued, --max-queue); send fewer prompts or a smaller n"
                )
            if self.waiting(len(requests)) + self.turns_waiting > self.max_queue:
                raise QueueFull(
                    f"the server's queue is full ({self.waiting()} requests waiting for {self.engine.slots} "
                    f"slot{'s' * (self.engine.slots != 1)} and {self.turns_waiting} attention requests for a "
                    f"turn, limit {self.max_queue}); retry later"
                )
            self._incoming += [(r, _Sink(queue, loop, i)) for i, r in enumerate(requests)]
            self._lock.notify()
        return queue

    def cancel(self, requests: list[Request]) -> None:
        """Stop requests (a client went away); their slots free before the next step."""
        with self._lock:
            self._cancels += requests
            self._lock.notify()

    def admit(self) -> None:
        """Admit one more piece of work that runs through :meth:`call` (an attention request) as
        :meth:`submit` admits a request: :attr:`turns_waiting` such pieces already wait for their turn.

        Raises:
            QueueFull: if the requests waiting for a slot and the pieces waiting reach ``max_queue``.
            Stopping: if the server is shutting down.
        """
        with self._lock:
            if self._closed or self._deadline is not None:
                raise Stopping(SHUTDOWN)
            if self.waiting() + self.turns_waiting >= self.max_queue:
                raise QueueFull(
                    f"the server's queue is full ({self.waiting()} requests waiting for a slot and "
                    f"{self.turns_waiting} attention requests for a turn, limit {self.max_queue}); retry "
                    "later"
                )

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the engine's thread between steps (e.g. a forward pass for prompt logprobs), one
        call between two steps. Raises :class:`Stopping` once :meth:`close` was called."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._closed:
                raise Stopping(SHUTDOWN)
            self._calls.append((fn, future, loop))
            self._lock.notify()
        return await future

    def stop(self, timeout: float) -> None:
        """Take no new requests; end what still runs ``timeout`` seconds from now with :data:`SHUTDOWN`."""
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + timeout
            self._lock.notify()

    def close(self) -> None:
        """Cancel everything still queued or running; :meth:`run` then returns."""
        with self._lock:
            self._closed = True
            self._lock.notify()

    def run(self) -> None:
        """Step while there is work, wait when there is none, until :meth:`close`."""
        while True:
            with self._lock:
                while not (
                    self._incoming or self._cancels or self._calls or self._closed or self.engine.has_work
                    or self._past_deadline()
                ):  # fmt: skip
                    self._lock.wait(0.5)  # (a timeout keeps signal handlers running in the main thread)
                if self._past_deadline():
                    self._end_all(SHUTDOWN)
                if self._closed:
                    self._cancels += [r for r, _ in self._incoming] + [r for r, _ in self._active.values()]
                # One call (a prompt's logprobs) between two steps: queued calls never stall the streams.
                incoming, cancels, calls = self._incoming, self._cancels, self._calls[:1]
                self._incoming, self._cancels, self._calls = [], [], self._calls[1:]
                gone = not self._closed  # (cancels at shutdown are no clients gone)
            for fn, future, loop in calls:
                self._answer(fn, future, loop)
            self._apply(incoming, cancels, gone)
            if self._closed and not self.engine.has_work:
                with self._lock:  # calls still queued are answered: no caller waits for good
                    calls, self._calls = self._calls, []
                for _, future, loop in calls:
                    self._answer(_refuse, future, loop)
                return
            if self.engine.has_work:
                self._step()

    @property
    def ending(self) -> bool:
        """Whether the shutdown's deadline has passed: what still runs is being ended."""
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _past_deadline(self) -> bool:
        return self.ending and bool(self._incoming or self._active)

    def _end_all(self, message: str) -> None:
        """End every queued and running request with ``message`` (their clients are told)."""
        for request, sink in self._incoming:
            self._active[id(request)] = (request, sink)
        self._incoming = []
        for request, _ in self._active.values():
            if not request.done:
                self.engine.cancel(request)
                request.error, request.finish_reason = message, "error"
        self._dispatch()

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            self.engine.step()
        except Exception as e:  # an engine fault fails what runs, never the server
            log.exception("engine step failed")
            for request, _ in list(self._active.values()):
                if not request.done:
                    self.engine.cancel(request)
                request.error, request.finish_reason = f"the engine failed: {e}", "error"
        self.metrics.steps += 1
        self.metrics.step_seconds += time.perf_counter() - start
        self._dispatch()

    @staticmethod
    def _answer(fn: Callable[[], Any], future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        def settle(ok: bool, value: Any) -> None:
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        try:
            result = (True, fn())
        except Exception as e:
            result = (False, e)
        loop.call_soon_threadsafe(settle, *result)

    def _apply(self, incoming: list[tuple[Request, _Sink]], cancels: list[Request],
               gone: bool = True) -> None:  # fmt: skip
        """Drop cancelled requests (counted where their clients are ``gone``) and join new ones (between steps
        only)."""
        cancelled, arriving = {id(r): r for r in cancels}, {id(r) for r, _ in incoming}
        for key, request in cancelled.items():
            joined = key in self._active
            if not request.done and (joined or key in arriving):  # (one cancelled as it came too)
                self.metrics.cancelled += gone
                if joined:
                    self.engine.cancel(request)
            self._active.pop(key, None)
        for request, sink in incoming:
            if id(request) in cancelled:
                continue
            self._active[id(request)] = (request, sink)
            self.metrics.prompt_tokens += len(request.prompt)
            try:
                self.engine.add(request)
            except ValueError as e:  # checked before submit; kept so a slip fails one request only
                request.error = str(e)
                request.finish("error")
        if incoming:
            self._dispatch()  # requests that finished on joining (max_tokens 0, or refused)

    def _dispatch(self) -> None:
        for key, (request, sink) in list(self._active.items()):
            new = request.token_ids[sink.sent :]
            if not new and not request.done:
                continue
            top = request.top_list[sink.sent :] if request.top_logprobs else [{} for _ in new]
            text = request.text.take(final=request.done) if request.text is not None else ""
            update = Update(sink.index, new, request.logprobs_list[sink.sent :], top, text)
            self.metrics.generated_tokens += len(new)
            sink.sent = len(request.token_ids)
            if request.done:
                update.finish_reason, update.error = request.finish_reason, request.error
                del self._active[key]
            sink.put(update)
