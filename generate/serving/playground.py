"""The playground's server side: the page at ``/``, its files, and ``POST /v1/attention``.

The page (``generate/serving/web/``) is plain HTML, CSS and JavaScript shipped in the package; it calls only
this server's public endpoints. ``/v1/attention`` returns the softmax attention weights of a text or a list of
token ids, for the layers, heads and query rows asked for: the full causal forward of
:meth:`generate.Generator.attention`, run in the engine's thread one layer a call between two decode steps
(about one decode step's work on the shipped model), after the same admission as generation (``--max-queue``
and the shutdown). Limits: :data:`MAX_TOKENS` tokens and :data:`MAX_WEIGHTS` weights a call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from generate.api import Generator, check_attention
from generate.engine.memory import said_plainly
from generate.serving import openai_api as oa
from generate.serving import openai_fields as fields
from generate.serving.answer import shutting_down, step_until_done
from generate.serving.engine_loop import EngineLoop, QueueFull, Stopping
from model import GPT, GPTConfig

MAX_TOKENS = 512  # tokens of one /v1/attention text
MAX_WEIGHTS = 2**20  # weights in one answer: layers x heads x query rows x tokens (about 15 MB of JSON)
FIELDS = {"model", "prompt", "layer", "head", "query"}
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# The page may load and call nothing but this server (and draws its favicon from a data: URL).
CSP = "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

Read = Callable[[HTTPRequest], Awaitable[tuple[Generator, EngineLoop, object]]]


@dataclass
class AttentionAsk:
    """One checked ``/v1/attention`` request: the token ids and the layers, heads and query rows wanted."""

    ids: list[int]
    layers: list[int]
    heads: list[int]
    queries: list[int]

    @property
    def weights(self) -> int:
        """How many weights the answer holds."""
        return len(self.layers) * len(self.heads) * len(self.queries) * len(self.ids)


def parse_attention(
    body: object, *, encode: Callable[..., list[int]], config: GPTConfig, vocab: int
) -> AttentionAsk:
    """Check a ``/v1/attention`` body: ``prompt`` (a string, or a non-empty list of token ids) and optional
    ``layer``, ``head`` and ``query`` (one of each; every one when left out). Raises :class:`oa.APIError`
    (400) naming the bad field, its value and the limit."""
    body = fields.check_fields(body, FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids = encode(prompt)
    elif fields.is_token_list(prompt):
        ids = list(prompt)
    else:
        raise fields.bad("prompt", "it must be a string or a non-empty list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise fields.bad("prompt", f"token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    window = config.n_positions
    if len(ids) > min(window, MAX_TOKENS):
        limit = f"the model's window holds {window}" if len(ids) > window else f"at most {MAX_TOKENS} a call"
        raise oa.APIError(
            f"prompt: it has {len(ids)} tokens, but {limit}; send a shorter text",
            param="prompt",
            code="context_length_exceeded" if len(ids) > window else "too_many_tokens",
        )
    layer = fields.integer(body, "layer", None, 0, config.n_layer - 1)
    head = fields.integer(body, "head", None, 0, config.n_head - 1)
    query = fields.integer(body, "query", None, 0, len(ids) - 1)
    ask = AttentionAsk(
        ids,
        list(range(config.n_layer)) if layer is None else [layer],
        list(range(config.n_head)) if head is None else [head],
        list(range(len(ids))) if query is None else [query],
    )
    if ask.weights > MAX_WEIGHTS:
        wider = next(name for name in ("layer", "head", "query") if body.get(name) is None)
        raise oa.APIError(
            f"{wider}: the answer would hold {len(ask.layers)} layers x {len(ask.heads)} heads x "
            f"{len(ask.queries)} query rows x {len(ids)} tokens = {ask.weights:,} weights, more than the "
            f"{MAX_WEIGHTS:,} a call may hold; ask for one layer (layer), one head (head) or one query "
            "row (query), or send a shorter text",
            param=wider,
            code="too_many_weights",
        )
    return ask


@dataclass
class AttentionJob:
    """The forward behind one :class:`AttentionAsk`, a layer a call, in the engine's thread.

    The same computation as :meth:`model.GPT.attention_weights` (the full causal forward; each layer's
    weights from the input that layer's forward gets), stopped after the last layer asked for. Only the heads
    and query rows asked for are kept, as lists (so no torch runs outside the engine's thread).
    """

    model: GPT
    ask: AttentionAsk
    layer: int = 0
    weights: list[list[list[list[float]]]] = field(default_factory=list)  # (layers, heads, queries, T)
    _x: Any = None  # the residual stream entering ``layer``, (1, T, C)

    @property
    def done(self) -> bool:
        return self.layer > self.ask.layers[-1]

    def step(self) -> None:
        """Run the next layer (the first call also embeds the tokens)."""
        import torch

        model, ask = self.model, self.ask
        with torch.inference_mode(), said_plainly("send a shorter text, or ask for fewer layers"):
            if self._x is None:
                ids = torch.tensor([ask.ids], device=model.device)
                positions = torch.arange(len(ask.ids), device=model.device)[None, :]  # (1, T)
                self._x = model.drop(model.wte(ids) + model.wpe(positions))
            block = model.h[self.layer]
            if self.layer in ask.layers:
                weights = block.attn.attention_weights(block.ln_1(self._x))[0]  # (nh, T, T)
                check_attention(weights, model.compute_dtype, f" in layer {self.layer}")  # (JSON has no NaN)
                self.weights.append(weights[ask.heads][:, ask.queries].float().cpu().tolist())
            self.layer += 1
            self._x = None if self.done else block(self._x)


class _Attention:
    """``POST /v1/attention``: admission, the job's calls between decode steps, the answer in pieces."""

    def __init__(self, read: Read, encoder: Callable[[Generator], Callable[..., list[int]]], name: str):
        self.read, self.encoder, self.name = read, encoder, name
        self.turns: asyncio.Semaphore | None = None  # at most a slot count of requests compute at once

    async def __call__(self, request: HTTPRequest, note: dict) -> Response:
        gen, loop, body = await self.read(request)
        vocab = min(gen.model.config.vocab_size, gen.tokenizer.n_vocab)
        ask = parse_attention(body, encode=self.encoder(gen), config=gen.model.config, vocab=vocab)
        note.update(tokens=len(ask.ids), weights=ask.weights)
        job = AttentionJob(gen.model, ask)
        await self._compute(job, loop, request, note)
        name = oa.TokenText(gen.tokenizer.decode_single_token_bytes)
        head = {"object": "attention", "model": self.name, "token_ids": ask.ids,
                "tokens": [name(t) for t in ask.ids], "layers": ask.layers, "heads": ask.heads,
                "queries": ask.queries}  # fmt: skip
        return StreamingResponse(_pieces(head, job.weights, note), media_type="application/json")

    async def _compute(self, job: AttentionJob, loop: EngineLoop, request: HTTPRequest, note: dict) -> None:
        """Admit the job as a request (its wait for a turn counts in the queue), then run its calls."""
        try:
            loop.admit()
        except QueueFull as e:
            raise oa.APIError(str(e), status=429, type="rate_limit_error", code="queue_full") from None
        except Stopping:
            raise shutting_down() from None
        self.turns = self.turns or asyncio.Semaphore(loop.engine.slots)
        loop.turns_waiting += 1  # (the asyncio thread's alone, as submit's check)
        try:
            await self.turns.acquire()
        finally:
            loop.turns_waiting -= 1
        try:
            await step_until_done(loop, request, note, job)
        except Stopping:
            raise shutting_down() from None
        except (MemoryError, RuntimeError, ValueError) as e:
            raise oa.APIError(str(e), status=500, type="server_error", code="attention_failed") from None
        finally:
            self.turns.release()


async def _pieces(head: dict[str, Any], weights: list, note: dict) -> AsyncIterator[str]:
    """The answer's JSON, one head's block of weights a piece: a large answer never holds the event loop
    (and the streams beside it) for long."""
    try:
        yield json.dumps(head, ensure_ascii=False)[:-1] + ', "weights": ['
        for i, layer in enumerate(weights):
            yield "," * (i > 0) + "["
            for j, block in enumerate(layer):
                yield "," * (j > 0) + json.dumps(block, separators=(",", ":"))
                await asyncio.sleep(0)
            yield "]"
        yield "]}"
    finally:
        note.pop("log", lambda: None)()


def _file(name: str) -> Response:
    """A file of the page, or a 404 for any name that is not one."""
    suffix = name[name.rfind(".") :] if "." in name else ""
    path = resources.files("generate.serving") / "web" / name
    if suffix not in TYPES or "/" in name or name.startswith(".") or not path.is_file():
        return Response(f"no file {name!r} here", status_code=404, media_type="text/plain; charset=utf-8")
    headers = {
        "Content-Security-Policy": CSP,
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
    }
    return Response(path.read_bytes(), media_type=TYPES[suffix], headers=headers)


async def _page(request: HTTPRequest) -> Response:
    return _file("index.html")


async def _asset(request: HTTPRequest) -> Response:
    return _file(request.path_params["name"])


def routes(
    logged: Callable[[str, Callable], Callable],
    read: Read,
    encoder: Callable[[Generator], Callable[..., list[int]]],
    model_name: str,
) -> list[Route]:
    """The playground's routes: ``GET /`` (the page), ``GET /playground/NAME`` (its files; neither needs the
    API key, as ``/health``) and ``POST /v1/attention`` (through ``logged``: the key, the log, the metrics).

    Args:
        logged: the server's wrapper of an endpoint ``(request, note) -> Response``.
        read: gives the model, the engine loop and a request's checked JSON body.
        encoder: makes the server's text encoder for a generator.
        model_name: the model id the server serves.
    """
    attention = _Attention(read, encoder, model_name)
    return [
        Route("/", _page, methods=["GET"]),
        Route("/playground/{name}", _asset, methods=["GET"]),
        Route("/v1/attention", logged("/v1/attention", attention), methods=["POST"]),
    ]
