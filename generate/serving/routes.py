"""The server's endpoints: each one a method of :class:`Endpoints`, which holds the server's state, and
:meth:`Endpoints.routes`, the table of them (with the playground's)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from generate.api import Generator
from generate.engine.engine import GenerationError
from generate.engine.request import Request
from generate.serving import checks, playground
from generate.serving import openai_api as oa
from generate.serving.answer import Answer, PromptScorer, shutting_down, step_until_done
from generate.serving.engine_loop import EngineLoop, QueueFull, Stopping, TooLarge
from generate.serving.metrics_text import metrics_text
from generate.serving.openai_fields import check_fields
from generate.serving.state import State
from generate.serving.streaming import ClientGone, failure, stream, wait_all

log = logging.getLogger("gptgen.server")


class Endpoints:
    """The HTTP endpoints of one server, over its :class:`State`."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.settings = state.settings

    def routes(self) -> list[Route]:
        """Every route: the API (through :meth:`logged`), ``/health`` and the playground's."""
        logged = self.logged
        return [
            Route("/v1/completions", logged("/v1/completions", self.completions), methods=["POST"]),
            Route("/v1/chat/completions", logged("/v1/chat/completions", self.chat), methods=["POST"]),
            Route("/v1/models", logged("/v1/models", self.models), methods=["GET"]),
            Route("/tokenize", logged("/tokenize", self.tokenize), methods=["POST"]),
            Route("/detokenize", logged("/detokenize", self.detokenize), methods=["POST"]),
            Route("/metrics", logged("/metrics", self.metrics), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            # the page, /v1/attention
            *playground.routes(logged, self.read, checks.encoder, self.settings.model_name),
        ]

    def logged(self, endpoint: str, fn: Callable) -> Callable:
        """``fn(request, note)`` behind the API key, its errors answered as OpenAI's, counted and logged (a
        stream when it ends) with what it put in ``note``."""

        async def handler(request: HTTPRequest) -> Response:
            start = time.perf_counter()
            note: dict[str, Any] = {}
            try:
                checks.check_auth(self.state, request)
                response = await fn(request, note)
            except oa.APIError as e:
                response = JSONResponse(e.body(), status_code=e.status)
                note["error"] = e.message
            if not isinstance(response, StreamingResponse):
                self._log(request, endpoint, response.status_code, start, note)
            else:  # (logged when the stream ends: 499 where its client went away first)
                status = lambda: 499 if note.get("cancelled") else response.status_code  # noqa: E731
                note["log"] = lambda: self._log(request, endpoint, status(), start, note)
            return response

        return handler

    def _log(self, request: HTTPRequest, endpoint: str, status: int, start: float, note: dict) -> None:
        if self.state.loop is not None:
            self.state.loop.metrics.count(endpoint, status)
        client = request.client.host if request.client else "-"
        extra = " ".join(f"{k}={v}" for k, v in note.items() if k != "log")
        failed = status >= 500 or (status < 400 and "error" in note)  # (or a stream that sent its error)
        log.log(
            logging.WARNING if failed else logging.INFO,
            "%s %s %s %d %.0f ms %s",
            client,
            request.method,
            endpoint,
            status,
            1000 * (time.perf_counter() - start),
            extra,
        )

    async def completions(self, request: HTTPRequest, note: dict) -> Response:
        """``POST /v1/completions``."""
        return await self._generation(request, note, chat=False)

    async def chat(self, request: HTTPRequest, note: dict) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._generation(request, note, chat=True)

    async def _generation(self, request: HTTPRequest, note: dict, chat: bool) -> Response:
        gen, loop = self.state.ready()
        body = await checks.read_json(request, self.settings)
        checks.check_model(self.state, body)
        job = _parse(gen, body, chat)
        try:
            requests = job.requests(gen.tokenizer.eot_token)
        except ValueError as e:  # (a stop string no text can hold, say)
            raise oa.APIError(str(e), code="invalid_value") from None
        answer = Answer(self.settings.model_name, gen, job, requests)
        queue = _submit(loop, requests)
        note.update(prompt=sum(len(p) for p in job.prompts), n=len(requests))
        if job.echo and job.logprobs is not None:  # admitted: a chunk of scoring between two steps
            await self._score_prompts(gen, loop, request, note, answer)
        if job.stream:
            return StreamingResponse(
                stream(answer, loop, queue, note),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _whole(request, note, answer, loop, queue)

    async def _score_prompts(
        self, gen: Generator, loop: EngineLoop, request: HTTPRequest, note: dict, answer: Answer
    ) -> None:
        """Score each prompt for echo (at most a slot's worth at once); a failure cancels the requests."""
        self.state.scoring = self.state.scoring or asyncio.Semaphore(loop.engine.slots)
        try:
            for p in answer.job.prompts:
                scorer = PromptScorer(gen, p, answer.job.logprobs or 0)
                async with self.state.scoring:
                    try:
                        await step_until_done(loop, request, note, scorer)
                    except GenerationError as e:  # (NaN logits: 500, as generating them)
                        raise failure(str(e)) from None
                answer.prompt_logprobs.append(scorer.logprobs)
                answer.prompt_top.append(scorer.alternatives)
        except BaseException:
            loop.cancel(answer.requests)
            raise

    async def models(self, request: HTTPRequest, note: dict) -> Response:
        """``GET /v1/models``: the one model served."""
        gen, _ = self.state.ready()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.settings.model_name,
                        "object": "model",
                        "created": self.state.created,
                        "owned_by": "gptgen",
                        "max_model_len": gen.model.config.n_positions,
                    }
                ],
            }
        )

    async def tokenize(self, request: HTTPRequest, note: dict) -> Response:
        """``POST /tokenize``: the token ids of a prompt, or of messages in the chat template."""
        gen, _ = self.state.ready()
        body = await checks.read_json(request, self.settings)
        checks.check_model(self.state, body)
        body = check_fields(body, {"model", "prompt", "messages"})
        if "messages" in body and "prompt" in body:  # (not one of them quietly)
            raise oa.APIError("give prompt or messages, not both", param="messages", code="invalid_value")
        if "messages" in body:
            text = oa.render_chat(body["messages"])
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise oa.APIError("prompt: it must be a string", param="prompt", code="invalid_value")
        tokens = checks.encoder(gen)(text, "messages" if "messages" in body else "prompt")
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": gen.model.config.n_positions}
        )

    async def detokenize(self, request: HTTPRequest, note: dict) -> Response:
        """``POST /detokenize``: the text of a list of token ids."""
        gen, _ = self.state.ready()
        body = await checks.read_json(request, self.settings)
        checks.check_model(self.state, body)
        body = check_fields(body, {"model", "tokens"})
        tokens, vocab = body.get("tokens"), gen.tokenizer.n_vocab
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

    async def read(self, request: HTTPRequest) -> tuple[Generator, EngineLoop, object]:
        """The model, the engine loop and the request's JSON body, checked against the model served."""
        gen, loop = self.state.ready()
        body = await checks.read_json(request, self.settings)
        checks.check_model(self.state, body)
        return gen, loop, body

    async def health(self, request: HTTPRequest) -> Response:
        """``GET /health``: 200 ``ok`` once the model is ready, else 503 (no API key needed)."""
        return JSONResponse(
            {"status": self.state.status}, status_code=200 if self.state.status == "ok" else 503
        )

    async def metrics(self, request: HTTPRequest, note: dict) -> Response:
        """``GET /metrics``: Prometheus's text format."""
        return PlainTextResponse(metrics_text(self.state), media_type="text/plain; version=0.0.4")

    async def errors(self, request: HTTPRequest, exc: Exception) -> Response:
        """Starlette's errors (404, 405) and unexpected exceptions, as OpenAI's error objects."""
        if isinstance(exc, HTTPException):
            return JSONResponse(
                oa.APIError(
                    f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code
                ).body(),
                status_code=exc.status_code,
                headers=exc.headers,  # (a 405's Allow)
            )
        log.exception("unexpected error")
        return JSONResponse(
            oa.APIError(f"internal error: {exc}", status=500, type="server_error").body(), 500
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """The application's lifespan: at its end, close the engine loop if there is one."""
        yield
        if self.state.loop is not None:
            self.state.loop.close()  # whatever still runs after the graceful shutdown is cancelled


def _parse(gen: Generator, body: object, chat: bool) -> oa.Job:
    """A completion or chat body checked against ``gen``."""
    window = gen.model.config.n_positions
    if chat:
        return oa.parse_chat(body, encode=checks.encoder(gen), vocab=checks.vocab(gen), window=window)
    return oa.parse_completion(
        body, encode=checks.encoder(gen), decode=gen.tokenizer.decode, vocab=checks.vocab(gen), window=window
    )


def _submit(loop: EngineLoop, requests: list[Request]) -> asyncio.Queue:
    """Hand ``requests`` to the engine; its refusals become 400, 429 or 503."""
    try:
        return loop.submit(requests)
    except TooLarge as e:
        raise oa.APIError(str(e), status=400, param="n", code="too_many_completions") from None
    except QueueFull as e:
        raise oa.APIError(str(e), status=429, type="rate_limit_error", code="queue_full") from None
    except Stopping as e:
        raise shutting_down() from e


async def _whole(
    request: HTTPRequest, note: dict, answer: Answer, loop: EngineLoop, queue: asyncio.Queue
) -> Response:
    """The whole answer once every choice finished; 499 when the client goes away first."""
    try:
        finals = await wait_all(request, queue, len(answer.requests))
    except (ClientGone, asyncio.CancelledError):
        loop.cancel(answer.requests)
        note["cancelled"] = True
        raise oa.APIError("the client went away", status=499, code="cancelled") from None
    failed = [u.error for u in finals if u.error]
    if failed:
        raise failure(failed[0])
    note["completion"] = sum(len(r.token_ids) for r in answer.requests)
    return JSONResponse(answer.whole())
