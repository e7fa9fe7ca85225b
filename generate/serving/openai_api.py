"""The OpenAI wire format: request bodies checked into engine requests, results shaped into OpenAI's objects.

Nothing here touches the network or the engine loop, so every rule (names, ranges, the chat template, the
logprobs layout) is a plain function the server calls and the tests call directly. The requests are checked in
:mod:`generate.serving.openai_jobs` (the bodies into jobs, the chat template) and
:mod:`generate.serving.openai_fields` (the error type, the fields and their checks), whose names are
importable from here too; this module shapes the results (``usage``, token names and offsets, logprobs).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from generate.engine.request import Request
from generate.serving.openai_fields import CHAT_FIELDS, COMMON, COMPLETION_FIELDS, UNSUPPORTED, APIError
from generate.serving.openai_jobs import (
    CHAT_ROLES,
    CHAT_STOPS,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_TOP_LOGPROBS,
    Job,
    parse_chat,
    parse_completion,
    render_chat,
)

__all__ = [
    "CHAT_FIELDS",
    "CHAT_ROLES",
    "CHAT_STOPS",
    "COMMON",
    "COMPLETION_FIELDS",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_STOP",
    "MAX_TOP_LOGPROBS",
    "UNSUPPORTED",
    "APIError",
    "Job",
    "TextOffsets",
    "TokenText",
    "chat_logprobs",
    "completion_logprobs",
    "parse_chat",
    "parse_completion",
    "render_chat",
    "usage",
]


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
    part of a UTF-8 character starts where that character will. ``unshown``: how many first tokens have no
    text; ``prompt``: how many first tokens are an echoed prompt, whose text is decoded alone (a character
    it leaves unfinished is a U+FFFD of its own, before the completion's text)."""

    def __init__(
        self, token_bytes: Callable[[int], bytes], start: int = 0, unshown: int = 0, prompt: int = 0
    ) -> None:
        self._token_bytes, self._offset, self._unshown = token_bytes, start, unshown  # (first: no text)
        self._prompt = prompt
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, tokens: list[int]) -> list[int]:
        """The offsets of ``tokens``, which follow the tokens of earlier calls."""
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._prompt -= 1
            if self._unshown:
                self._unshown -= 1
                continue
            self._offset += len(self._decoder.decode(self._token_bytes(t), final=self._prompt == 0))
        return offsets


def completion_logprobs(
    tokens: list[int],
    logprobs: list[float | None],
    top: list[dict[int, float] | None],
    name: TokenText,
    offset: int | TextOffsets,
) -> dict[str, Any]:
    """The completions ``logprobs`` object: tokens, their logprobs, the alternatives (as OpenAI's, the token
    itself among them: up to ``logprobs`` + 1), and where each token's text starts in the choice's text
    (``offset``: the first one's, or a :class:`TextOffsets` carried on from the previous chunk)."""
    names = [name(t) for t in tokens]
    offsets = (offset if isinstance(offset, TextOffsets) else TextOffsets(name.token_bytes, offset))(tokens)
    alternatives = [
        None if alt is None else {name(t): lp for t, lp in alt.items()} | {names[i]: logprobs[i]}
        for i, alt in enumerate(top)
    ]
    return {"tokens": names, "token_logprobs": logprobs, "text_offset": offsets, "top_logprobs": alternatives}


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
