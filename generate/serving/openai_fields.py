"""The checks the OpenAI endpoints share: the error every refused request raises, the fields each endpoint
takes, and the checks of one field's value (an integer, a number, a flag, a prompt of token ids).

Every check raises :class:`APIError` (400) naming the field and what it must be.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from checkpoints.errors import elide
from generate.engine.request import check_prompt

# Fields each endpoint takes; any other field is refused by name. OpenAI fields this server does not
# implement are accepted only at their no-op value (``UNSUPPORTED``).
COMMON = {
    "model",
    "return_token_ids",
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
UNSUPPORTED = {  # OpenAI's fields that completions and chat take only at their defaults (no-ops)
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
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo"} | set(UNSUPPORTED)
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"} | set(UNSUPPORTED)


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


def bad(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param, code="invalid_value")


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


def integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
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
        raise bad(name, f"got {value!r}; it must be {valid}")
    return value


def number(body: dict, name: str, default: float, ok: Callable[[float], bool], valid: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    try:  # (a JSON integer of 400 digits is a Python int that no float holds)
        number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except OverflowError:
        number = math.nan
    if not math.isfinite(number) or not ok(number):
        raise bad(name, f"got {short(value)}; it must be {valid}")
    return number


def boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"got {value!r}; it must be true or false")
    return value


def check_fields(body: object, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, value in body.items():
        if name not in allowed:
            raise APIError(
                f"unrecognized request field {name!r}; see the README's server section",
                param=name,
                code="unknown_field",
            )
        defaults = UNSUPPORTED.get(name)
        if defaults is not None and not any(value == ok and type(value) is type(ok) for ok in defaults):
            raise bad(name, f"got {value!r}; this server does not support {name} (leave it out)")
    return body


def is_token_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def check_prompt_ids(ids: list[int], vocab: int, window: int, param: str) -> None:
    try:
        check_prompt(ids, vocab, window)
    except ValueError as e:
        raise APIError(
            f"{param}: {e}",
            param=param,
            code="context_length_exceeded" if len(ids) >= window else "invalid_value",
        ) from None
