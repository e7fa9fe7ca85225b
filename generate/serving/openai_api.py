"""The OpenAI wire format: request bodies checked into engine requests, results shaped into OpenAI's objects.

Nothing here touches the network or the engine loop, so every rule (names, ranges, the chat template, the
logprobs layout) is a plain function the server calls and the tests call directly.

Chat template (GPT-2 has none of its own): each message becomes a line ``"<Role>: <content>"`` (``System``,
``User`` or ``Assistant``), the lines are joined by newlines and ``"\\nAssistant:"`` is appended; the reply
ends where the model starts another turn (the stop strings ``"\\nUser:"`` and ``"\\nSystem:"``, added to the
request's own).
"""

from __future__ import annotations

import codecs
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from checkpoints.errors import elide
from generate.engine.request import Request, check_prompt
from generate.engine.sampling import SamplingParams

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP = 8  # stop strings per request
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOPS = ("\nUser:", "\nSystem:")

# Fields each endpoint takes; any other field is refused by name. OpenAI fields this server does not
# implement are accepted only at their no-op value (``UNSUPPORTED``).
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
UNSUPPORTED = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None,),
    "metadata": (None,),
    "store": (None, False),
}


class APIError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        message, param = elide(message), None if param is None else elide(param, 60)  # values sent back
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param, code="invalid_value")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


def _int(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        valid = f"an integer in {low}..{high}" if high is not None else f"an integer >= {low}"
        raise _bad(name, f"got {value!r}; it must be {valid}")
    return value


def _number(body: dict, name: str, default: float, ok: Callable[[float], bool], valid: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    try:  # (a JSON integer of 400 digits is a Python int that no float holds)
        number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except OverflowError:
        number = math.nan
    if not math.isfinite(number) or not ok(number):
        raise _bad(name, f"got {_short(value)}; it must be {valid}")
    return number


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"got {value!r}; it must be true or false")
    return value


def _check_fields(body: object, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, value in body.items():
        if name in UNSUPPORTED:
            if not any(value == ok and type(value) is type(ok) for ok in UNSUPPORTED[name]):
                raise _bad(name, f"got {value!r}; this server does not support {name} (leave it out)")
        elif name not in allowed:
            raise APIError(
                f"unrecognized request field {name!r}; see the README's server section",
                param=name,
                code="unknown_field",
            )
    return body


@dataclass
class Job:
    """One checked request: its prompts (token ids), how many choices each, and every option.

    ``logprobs`` is the number of alternatives to report at each token (None: no logprobs at all).
    """

    chat: bool
    prompts: list[list[int]]
    n: int
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    seed: int | None
    logprobs: int | None
    echo: bool
    stream: bool
    include_usage: bool
    user: str | None
    prompt_texts: list[str] = field(default_factory=list)

    def requests(self, eos_id: int) -> list[Request]:
        """The engine requests, prompt by prompt and choice by choice: choice ``j`` of a seeded request
        uses ``seed + j``, so choice 0 equals the same request with ``n=1`` (and the offline API's)."""
        stop = self.stop + (CHAT_STOPS if self.chat else ())
        return [
            Request(
                p,
                self.sampling,
                self.max_tokens,
                seed=None if self.seed is None else self.seed + j,
                eos_id=eos_id,
                stop=stop,
                logprobs=self.logprobs is not None,
                top_logprobs=self.logprobs or 0,
            )
            for p in self.prompts
            for j in range(self.n)
        ]


def _options(body: dict) -> dict[str, Any]:
    """The options both endpoints share."""
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, lambda v: v >= 0, ">= 0 (0 means greedy)"),
        top_p=_number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=_int(body, "top_k", 0, 0),
        min_p=_number(body, "min_p", 0.0, lambda v: 0 <= v < 1, "in [0, 1)"),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, lambda v: v > 0, "> 0 (1 disables it)"),
        presence_penalty=_number(body, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
    )
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise _bad(
            "stop",
            f"got {body.get('stop')!r}; it must be a non-empty string or a list of at most "
            f"{MAX_STOP} non-empty strings",
        )
    n = _int(body, "n", 1, 1, MAX_N)
    seed = _int(body, "seed", None, 0, 2**64 - n)
    stream_options = body.get("stream_options")
    if stream_options is not None and (
        not isinstance(stream_options, dict)
        or set(stream_options) - {"include_usage"}
        or not isinstance(stream_options.get("include_usage", False), bool)
    ):
        raise _bad("stream_options", f'got {stream_options!r}; it must be {{"include_usage": true|false}}')
    stream = _bool(body, "stream")
    if stream_options is not None and not stream:
        raise _bad("stream_options", "it applies only with stream: true")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"got {user!r}; it must be a string")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"got {model!r}; it must be a string (see GET /v1/models)")
    return dict(
        sampling=sampling,
        stop=tuple(stop),
        n=n,
        seed=seed,
        stream=stream,
        user=user,
        include_usage=bool(stream_options and stream_options.get("include_usage")),
    )


def _token_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _check_prompt(ids: list[int], vocab: int, window: int, param: str) -> None:
    try:
        check_prompt(ids, vocab, window)
    except ValueError as e:
        raise APIError(
            f"{param}: {e}",
            param=param,
            code="context_length_exceeded" if len(ids) >= window else "invalid_value",
        ) from None


def parse_completion(
    body: object,
    *,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    vocab: int,
    window: int,
) -> Job:
    """Check a ``/v1/completions`` body. ``prompt`` is a string, a list of strings, a list of token ids, or
    a list of such lists. Raises :class:`APIError` (400) naming the first bad field and its limit."""
    body = _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _token_list(prompt):
        prompt = [prompt]
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(p, str) or _token_list(p) for p in prompt)
    ):
        raise _bad(
            "prompt",
            "it must be a string, a list of strings, a list of token ids or a list of lists of "
            "token ids (none empty)",
        )
    if len(prompt) > MAX_PROMPTS:
        raise _bad("prompt", f"got {len(prompt)} prompts; at most {MAX_PROMPTS} per request")
    ids = [encode(p) if isinstance(p, str) else list(p) for p in prompt]
    for i, p in enumerate(ids):
        _check_prompt(p, vocab, window, "prompt" if len(ids) == 1 else f"prompt[{i}]")
    logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    options = _options(body)
    return Job(
        chat=False,
        prompts=ids,
        max_tokens=_int(body, "max_tokens", 16, 0),
        logprobs=logprobs,
        echo=_bool(body, "echo"),
        prompt_texts=[p if isinstance(p, str) else decode(p) for p in prompt],
        **options,
    )


def render_chat(messages: object) -> str:
    """The documented chat template (module docstring). Raises :class:`APIError` for bad messages."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "it must be a non-empty list of {role, content} objects")
    lines = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise _bad(where, f"each message needs a role, one of {', '.join(CHAT_ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise _bad(f"{where}.content", "only text parts ({type: text, text}) are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"{where}.content", f"got {content!r}; it must be a string or a list of text parts")
        lines.append(f"{CHAT_ROLES[message['role']]}: {content}")
    return "\n".join(lines) + "\nAssistant:"


def parse_chat(body: object, *, encode: Callable[[str], list[int]], vocab: int, window: int) -> Job:
    """Check a ``/v1/chat/completions`` body; the messages are rendered with :func:`render_chat`.
    ``max_completion_tokens`` (or ``max_tokens``) defaults to the rest of the window."""
    body = _check_fields(body, CHAT_FIELDS)
    text = render_chat(body.get("messages"))
    ids = encode(text)
    _check_prompt(ids, vocab, window, "messages")
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and body.get("logprobs") is not True:
        raise _bad("top_logprobs", "it needs logprobs: true")
    limit = _int(body, "max_completion_tokens", None, 0)
    old_limit = _int(body, "max_tokens", window, 0)  # checked even when max_completion_tokens is given
    limit = old_limit if limit is None else limit
    return Job(
        chat=True,
        prompts=[ids],
        max_tokens=limit,
        logprobs=(top or 0) if _bool(body, "logprobs") else None,
        echo=False,
        prompt_texts=[text],
        **_options(body),
    )


def usage(requests: list[Request], prompt_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage``: the prompts' tokens (each prompt once) and every choice's generated tokens."""
    completion = sum(len(r.token_ids) for r in requests)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


@dataclass
class TokenText:
    """Turns token ids into the strings OpenAI's logprobs show (a token that is part of a UTF-8 character
    shows as ``bytes:\\xNN``, as OpenAI writes it)."""

    token_bytes: Callable[[int], bytes]

    def __call__(self, token: int) -> str:
        raw = self.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Where each token's text starts in a choice's text, in characters, token by token: a token holding
    part of a UTF-8 character starts where that character will."""

    def __init__(self, token_bytes: Callable[[int], bytes], start: int = 0) -> None:
        self._token_bytes, self._offset = token_bytes, start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, tokens: list[int]) -> list[int]:
        """The offsets of ``tokens``, which follow the tokens of earlier calls."""
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(self._decoder.decode(self._token_bytes(t)))
        return offsets


def completion_logprobs(
    tokens: list[int],
    logprobs: list[float | None],
    top: list[dict[int, float] | None],
    name: TokenText,
    offset: int | TextOffsets,
) -> dict[str, Any]:
    """The completions ``logprobs`` object: tokens, their logprobs, the alternatives, and where each token's
    text starts in the choice's text (``offset``: the first one's, or a :class:`TextOffsets` carried on from
    the previous chunk)."""
    names = [name(t) for t in tokens]
    offsets = (offset if isinstance(offset, TextOffsets) else TextOffsets(name.token_bytes, offset))(tokens)
    return {
        "tokens": names,
        "token_logprobs": logprobs,
        "text_offset": offsets,
        "top_logprobs": [None if alt is None else {name(t): lp for t, lp in alt.items()} for alt in top],
    }


def chat_logprobs(
    tokens: list[int],
    logprobs: list[float],
    top: list[dict[int, float]],
    token_bytes: Callable[[int], bytes],
    name: TokenText,
) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def entry(t: int, lp: float) -> dict[str, Any]:
        return {"token": name(t), "logprob": lp, "bytes": list(token_bytes(t))}

    return {
        "content": [
            entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in alt.items()]}
            for t, lp, alt in zip(tokens, logprobs, top, strict=True)
        ]
    }
