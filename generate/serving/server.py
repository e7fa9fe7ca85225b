"""The OpenAI-compatible HTTP server (Starlette): routes, request bodies, streaming, errors, metrics.

The model loads in the background after the server starts listening, so ``/health`` answers 503 while it
loads or compiles; everything else waits for it. One :class:`generate.serving.engine_loop.EngineLoop` runs
every request; this module only turns HTTP into engine requests and engine updates into OpenAI's objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from generate.api import Generator
from generate.engine.engine import Engine
from generate.serving import openai_api as oa
from generate.serving import playground
from generate.serving.answer import Answer, PromptScorer, shutting_down, sse, step_until_done
from generate.serving.engine_loop import SHUTDOWN, EngineLoop, QueueFull, Stopping, TooLarge, Update

log = logging.getLogger("gptgen.server")
MAX_BODY = 4 * 2**20  # bytes of request body; a full window of token ids is far smaller


@dataclass
class Settings:
    """What ``gptgen serve`` was started with (see :mod:`generate.tools.serve`)."""

    model_name: str
    max_queue: int = 256
    api_key: str | None = None
    max_body: int = MAX_BODY
    body_timeout: float = 30.0


@dataclass
class State:
    """The server's live state: ``loading`` until :meth:`attach` gives it the model, then ``ok``."""

    settings: Settings
    status: str = "loading"
    gen: Generator | None = None
    loop: EngineLoop | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    scoring: asyncio.Semaphore | None = None  # prompts scored for echo at once (each holds a KV cache)

    def attach(self, gen: Generator, engine: Engine) -> EngineLoop:
        """Serve ``gen`` through ``engine`` from now on; returns the loop for the engine's thread to run."""
        self.gen, self.loop = gen, EngineLoop(engine, self.settings.max_queue)
        self.status = "ok"
        log.info(
            "ready: %s, %d slots, queue of %d", self.settings.model_name, engine.slots, self.loop.max_queue
        )
        return self.loop

    def ready(self) -> tuple[Generator, EngineLoop]:
        """The model and loop, or a 503 while loading."""
        if self.gen is None or self.loop is None:
            raise oa.APIError(
                f"the model is {self.status}; retry when GET /health says ok",
                status=503,
                type="server_error",
                code="not_ready",
            )
        return self.gen, self.loop


def _check_auth(state: State, request: HTTPRequest) -> None:
    key = state.settings.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise oa.APIError(
            "missing or wrong API key; send Authorization: Bearer <key>", status=401, code="invalid_api_key"
        )


async def _read_json(request: HTTPRequest, settings: Settings) -> object:
    limit, length = settings.max_body, request.headers.get("content-length")
    too_big = oa.APIError(
        f"the request body exceeds {limit:,} bytes; send a smaller request", status=413, code="body_too_large"
    )
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise too_big

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        body = await asyncio.wait_for(read(), settings.body_timeout)
    except asyncio.TimeoutError:
        raise oa.APIError(
            f"the request body did not arrive within {settings.body_timeout:g} s (--body-timeout); send it "
            "at once",
            status=408,
            code="body_timeout",
        ) from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise oa.APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None


def _encoder(gen: Generator) -> Callable[[str], list[int]]:
    def encode(text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise oa.APIError(
                "the text holds a lone UTF-16 surrogate; send valid Unicode", code="invalid_value"
            ) from None
        return gen.encode(text)

    return encode


def _vocab(gen: Generator) -> int:
    return min(gen.model.config.vocab_size, gen.tokenizer.n_vocab)


def _check_model(state: State, body: object) -> None:
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and model != state.settings.model_name:
        raise oa.APIError(
            f"model {model!r} is not served here; this server serves "
            f"{state.settings.model_name!r} (GET /v1/models)",
            status=404,
            param="model",
            code="model_not_found",
        )


async def _wait_all(request: HTTPRequest, queue: asyncio.Queue, count: int) -> list[Update]:
    """Collect updates until ``count`` choices finished; a client that goes away raises ClientGone."""
    finals = []
    while len(finals) < count:
        getter = asyncio.ensure_future(queue.get())
        while not getter.done():
            await asyncio.wait({getter}, timeout=0.25)
            if not getter.done() and await request.is_disconnected():
                getter.cancel()
                raise _ClientGone
        update = getter.result()
        if update.finish_reason is not None:
            finals.append(update)
    return finals


class _ClientGone(Exception):
    pass


def _failure(error: str) -> oa.APIError:
    """The answer to a request the engine ended with ``error``: 503 at shutdown, else 500."""
    if error == SHUTDOWN:
        return shutting_down()
    return oa.APIError(error, status=500, type="server_error", code="generation_failed")


def build_app(settings: Settings) -> Starlette:
    """The Starlette application; :func:`generate.tools.serve.main` runs it under uvicorn."""
    state = State(settings)

    def logged(endpoint: str, fn: Callable) -> Callable:
        async def handler(request: HTTPRequest) -> Response:
            start = time.perf_counter()
            note: dict[str, Any] = {}
            try:
                _check_auth(state, request)
                response = await fn(request, note)
            except oa.APIError as e:
                response = JSONResponse(e.body(), status_code=e.status)
                note["error"] = e.message
            if not isinstance(response, StreamingResponse):
                _log(request, endpoint, response.status_code, start, note)
            else:
                note["log"] = lambda: _log(request, endpoint, response.status_code, start, note)
            return response

        return handler

    def _log(request: HTTPRequest, endpoint: str, status: int, start: float, note: dict) -> None:
        if state.loop is not None:
            state.loop.metrics.count(endpoint, status)
        client = request.client.host if request.client else "-"
        extra = " ".join(f"{k}={v}" for k, v in note.items() if k != "log")
        log.info(
            "%s %s %s %d %.0f ms %s",
            client,
            request.method,
            endpoint,
            status,
            1000 * (time.perf_counter() - start),
            extra,
        )

    async def generation(request: HTTPRequest, note: dict, chat: bool) -> Response:
        gen, loop = state.ready()
        body = await _read_json(request, settings)
        _check_model(state, body)
        window = gen.model.config.n_positions
        if chat:
            job = oa.parse_chat(body, encode=_encoder(gen), vocab=_vocab(gen), window=window)
        else:
            job = oa.parse_completion(
                body, encode=_encoder(gen), decode=gen.tokenizer.decode, vocab=_vocab(gen), window=window
            )
        try:
            requests = job.requests(gen.tokenizer.eot_token)
        except ValueError as e:  # (a stop string no text can hold, say)
            raise oa.APIError(str(e), code="invalid_value") from None
        answer = Answer(settings.model_name, gen, job, requests)
        try:
            queue = loop.submit(requests)
        except TooLarge as e:
            raise oa.APIError(str(e), status=400, param="n", code="too_many_completions") from None
        except QueueFull as e:
            raise oa.APIError(str(e), status=429, type="rate_limit_error", code="queue_full") from None
        except Stopping as e:
            raise shutting_down() from e
        note.update(prompt=sum(len(p) for p in job.prompts), n=len(requests))
        if job.echo and job.logprobs is not None:  # admitted: a chunk of scoring between two steps
            state.scoring = state.scoring or asyncio.Semaphore(loop.engine.slots)
            try:
                for p in job.prompts:
                    scorer = PromptScorer(gen, p)
                    async with state.scoring:
                        await step_until_done(loop, request, note, scorer)
                    answer.prompt_logprobs.append(scorer.logprobs)
            except BaseException:
                loop.cancel(requests)
                raise
        if job.stream:
            return StreamingResponse(
                _stream(answer, loop, queue, note),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            finals = await _wait_all(request, queue, len(requests))
        except (_ClientGone, asyncio.CancelledError):
            loop.cancel(requests)
            note["cancelled"] = True
            raise oa.APIError("the client went away", status=499, code="cancelled") from None
        failed = [u.error for u in finals if u.error]
        if failed:
            raise _failure(failed[0])
        note["completion"] = sum(len(r.token_ids) for r in requests)
        return JSONResponse(answer.whole())

    async def _stream(
        answer: Answer, loop: EngineLoop, queue: asyncio.Queue, note: dict
    ) -> AsyncIterator[str]:
        finished = 0
        try:
            for chunk in answer.stream_start():
                yield sse(chunk)
            while finished < len(answer.requests):
                update: Update = await queue.get()
                if update.error:
                    yield sse(_failure(update.error).body())
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
                note["cancelled"] = True
            note["completion"] = sum(len(r.token_ids) for r in answer.requests)
            note.pop("log", lambda: None)()

    async def completions(request: HTTPRequest, note: dict) -> Response:
        return await generation(request, note, chat=False)

    async def chat(request: HTTPRequest, note: dict) -> Response:
        return await generation(request, note, chat=True)

    async def models(request: HTTPRequest, note: dict) -> Response:
        gen, _ = state.ready()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": settings.model_name,
                        "object": "model",
                        "created": state.created,
                        "owned_by": "gptgen",
                        "max_model_len": gen.model.config.n_positions,
                    }
                ],
            }
        )

    async def tokenize(request: HTTPRequest, note: dict) -> Response:
        gen, _ = state.ready()
        body = await _read_json(request, settings)
        _check_model(state, body)
        if not isinstance(body, dict) or set(body) - {"model", "prompt", "messages"}:
            raise oa.APIError('send {"prompt": text} or {"messages": [...]} (the chat template)', param=None)
        if "messages" in body:
            text = oa.render_chat(body["messages"])
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise oa.APIError("prompt: it must be a string", param="prompt", code="invalid_value")
        tokens = _encoder(gen)(text)
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": gen.model.config.n_positions}
        )

    async def detokenize(request: HTTPRequest, note: dict) -> Response:
        gen, _ = state.ready()
        body = await _read_json(request, settings)
        _check_model(state, body)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        vocab = gen.tokenizer.n_vocab
        if not (
            isinstance(tokens, list)
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens)
        ):
            raise oa.APIError(
                f"tokens: it must be a list of token ids in 0..{vocab - 1}",
                param="tokens",
                code="invalid_value",
            )
        return JSONResponse({"prompt": gen.tokenizer.decode(tokens)})

    async def read(request: HTTPRequest) -> tuple[Generator, EngineLoop, object]:
        gen, loop = state.ready()
        body = await _read_json(request, settings)
        _check_model(state, body)
        return gen, loop, body

    async def health(request: HTTPRequest) -> Response:
        return JSONResponse({"status": state.status}, status_code=200 if state.status == "ok" else 503)

    async def metrics(request: HTTPRequest, note: dict) -> Response:
        return PlainTextResponse(_metrics_text(state), media_type="text/plain; version=0.0.4")

    async def errors(request: HTTPRequest, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            return JSONResponse(
                oa.APIError(
                    f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code
                ).body(),
                status_code=exc.status_code,
            )
        log.exception("unexpected error")
        return JSONResponse(
            oa.APIError(f"internal error: {exc}", status=500, type="server_error").body(), 500
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if state.loop is not None:
            state.loop.close()  # whatever still runs after the graceful shutdown is cancelled

    routes = [
        Route("/v1/completions", logged("/v1/completions", completions), methods=["POST"]),
        Route("/v1/chat/completions", logged("/v1/chat/completions", chat), methods=["POST"]),
        Route("/v1/models", logged("/v1/models", models), methods=["GET"]),
        Route("/tokenize", logged("/tokenize", tokenize), methods=["POST"]),
        Route("/detokenize", logged("/detokenize", detokenize), methods=["POST"]),
        Route("/metrics", logged("/metrics", metrics), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        *playground.routes(logged, read, _encoder, settings.model_name),  # the page, /v1/attention
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: errors, Exception: errors}
    )
    app.state.gptgen = state
    return app


def _metrics_text(state: State) -> str:
    lines = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP gptgen_{name} {help}", f"# TYPE gptgen_{name} {kind}"])
        lines.extend(f"gptgen_{name}{labels} {value:g}" for labels, value in samples)

    loop = state.loop
    m = loop.metrics if loop is not None else None
    requests = (
        [(f'{{endpoint="{e}",status="{s}"}}', c) for (e, s), c in sorted(m.requests.items())] if m else []
    )
    metric("requests_total", "counter", "HTTP requests answered, by endpoint and status.", requests)
    metric(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens of requests that joined the engine.",
        [("", m.prompt_tokens if m else 0)],
    )
    metric("generation_tokens_total", "counter", "Tokens generated.", [("", m.generated_tokens if m else 0)])
    metric(
        "requests_cancelled_total",
        "counter",
        "Requests stopped because the client went away.",
        [("", m.cancelled if m else 0)],
    )
    metric("queue_depth", "gauge", "Requests waiting for a slot.", [("", loop.queued if loop else 0)])
    metric("slots_busy", "gauge", "Slots running a request.", [("", loop.busy if loop else 0)])
    metric("slots_total", "gauge", "Slots of the engine.", [("", loop.engine.slots if loop else 0)])
    metric(
        "step_seconds",
        "summary",
        "Time of engine steps.",
        [("_sum", m.step_seconds if m else 0), ("_count", m.steps if m else 0)],
    )
    spec = loop.engine.speculator if loop is not None else None
    if spec is not None:
        stats = spec.stats()
        metric("speculative_proposed_total", "counter", "Tokens proposed.", [("", stats["proposed"])])
        metric(
            "speculative_accepted_total", "counter", "Proposed tokens accepted.", [("", stats["accepted"])]
        )
        metric(
            "speculative_acceptance_rate", "gauge", "Accepted / proposed.", [("", stats["acceptance_rate"])]
        )
        metric(
            "speculative_tokens_per_pass",
            "gauge",
            "Tokens a row gains per step.",
            [("", stats["tokens_per_pass"])],
        )
    metric(
        "ready", "gauge", "1 once the model is loaded (and compiled).", [("", float(state.status == "ok"))]
    )
    return "\n".join(lines) + "\n"
