"""A request's checks before it reaches the engine: the API key, the JSON body, the model name, the text."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from generate.api import Generator
from generate.serving import openai_api as oa
from generate.serving.openai_fields import bad
from generate.serving.state import Settings, State


def check_auth(state: State, request: HTTPRequest) -> None:
    """Raise 401 unless the request carries the server's API key (when it has one) as a bearer token."""
    key = state.settings.api_key
    if key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # (the scheme's case does not matter in HTTP: curl users write "bearer")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise oa.APIError(
            "missing or wrong API key; send Authorization: Bearer <key>", status=401, code="invalid_api_key"
        )


async def read_json(request: HTTPRequest, settings: Settings) -> object:
    """The request's body as JSON: 413 past ``settings.max_body`` bytes, 408 when it does not arrive within
    ``settings.body_timeout`` seconds, 400 when it is not JSON, 499 when the client leaves while sending
    it."""
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
    except ClientDisconnect:  # (no one to answer: logged as gone, as a stream whose client left)
        raise oa.APIError("the client went away", status=499, code="cancelled") from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise oa.APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None


MAX_TOKEN_CHARS = 128  # the most characters a token's text has (the GPT-2 tokenizer's longest: 128 bytes)


def encoder(gen: Generator) -> Callable[..., list[int]]:
    """``gen``'s text encoder, ``encode(text, field="prompt")``, refusing (400, naming the field) a text that
    is not valid Unicode, or one of more characters than a window of tokens can hold, before encoding it (a
    huge text would hold up every other request while it is encoded)."""
    window = gen.model.config.n_positions

    def encode(text: str, field: str = "prompt") -> list[int]:
        if len(text) > (most := window * MAX_TOKEN_CHARS):
            raise oa.APIError(f"{field}: the text has {len(text):,} characters, more than {window} tokens "
                              f"(the window) can hold ({most:,} at most); send a shorter text", param=field,
                              code="context_length_exceeded")  # fmt: skip
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise bad(field, "the text holds a lone UTF-16 surrogate; send valid Unicode") from None
        return gen.encode(text)

    return encode


def vocab(gen: Generator) -> int:
    """The token ids a request may use: those both the model and the tokenizer know."""
    return min(gen.model.config.vocab_size, gen.tokenizer.n_vocab)


def check_model(state: State, body: object) -> None:
    """Raise 400 when the body's model is no string, 404 when it names a model other than the one served."""
    model = body.get("model") if isinstance(body, dict) else None
    if model is not None and not isinstance(model, str):
        raise bad("model", f"got {model!r}; it must be a string (see GET /v1/models)")
    if isinstance(model, str) and model != state.settings.model_name:
        raise oa.APIError(
            f"model {model!r} is not served here; this server serves "
            f"{state.settings.model_name!r} (GET /v1/models)",
            status=404,
            param="model",
            code="model_not_found",
        )
