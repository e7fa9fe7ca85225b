"""OpenAI request bodies checked into jobs: ``/v1/completions`` and ``/v1/chat/completions`` bodies become a
:class:`Job`, whose :meth:`Job.requests` are the engine's requests.

Chat template (GPT-2 has none of its own): each message becomes a line ``"<Role>: <content>"`` (``System``,
``User`` or ``Assistant``), the lines are joined by newlines and ``"\\nAssistant:"`` is appended; the reply
ends where the model starts another turn (the stop strings ``"\\nUser:"`` and ``"\\nSystem:"``, added to the
request's own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from generate.engine.request import Request, check_stop
from generate.engine.sampling import SamplingParams
from generate.serving.openai_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    bad,
    boolean,
    check_fields,
    check_prompt_ids,
    integer,
    is_token_list,
    number,
)

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP = 8  # stop strings per request
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOPS = ("\nUser:", "\nSystem:")


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
    token_ids: bool = False  # return_token_ids (vLLM's extension): each choice's token ids, the prompt's too

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
        temperature=number(body, "temperature", 1.0, lambda v: v >= 0, ">= 0 (0 means greedy)"),
        top_p=number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=integer(body, "top_k", 0, 0),
        min_p=number(body, "min_p", 0.0, lambda v: 0 <= v < 1, "in [0, 1)"),
        repetition_penalty=number(body, "repetition_penalty", 1.0, lambda v: v > 0, "> 0 (1 disables it)"),
        presence_penalty=number(body, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
        frequency_penalty=number(body, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
    )
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise bad(
            "stop",
            f"got {body.get('stop')!r}; it must be a non-empty string or a list of at most "
            f"{MAX_STOP} non-empty strings",
        )
    try:
        check_stop(stop)  # (no lone surrogate)
    except ValueError as e:
        raise bad("stop", str(e)) from None
    n = integer(body, "n", 1, 1, MAX_N)
    seed = integer(body, "seed", None, 0, 2**64 - n)
    stream_options = body.get("stream_options")
    if stream_options is not None and (
        not isinstance(stream_options, dict)
        or set(stream_options) - {"include_usage"}
        or not isinstance(stream_options.get("include_usage", False), bool)
    ):
        raise bad("stream_options", f'got {stream_options!r}; it must be {{"include_usage": true|false}}')
    stream = boolean(body, "stream")
    if stream_options is not None and not stream:
        raise bad("stream_options", "it applies only with stream: true")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"got {user!r}; it must be a string")
    return dict(
        sampling=sampling,
        stop=tuple(stop),
        n=n,
        seed=seed,
        stream=stream,
        user=user,
        include_usage=bool(stream_options and stream_options.get("include_usage")),
        token_ids=boolean(body, "return_token_ids"),
    )


def parse_completion(
    body: object,
    *,
    encode: Callable[..., list[int]],
    decode: Callable[[list[int]], str],
    vocab: int,
    window: int,
) -> Job:
    """Check a ``/v1/completions`` body. ``prompt`` is a string, a list of strings, a list of token ids, or
    a list of such lists. Raises :class:`APIError` (400) naming the first bad field and its limit."""
    body = check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or is_token_list(prompt):
        prompt = [prompt]
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(p, str) or is_token_list(p) for p in prompt)
    ):
        raise bad(
            "prompt",
            "it must be a string, a list of strings, a list of token ids or a list of lists of "
            "token ids (none empty)",
        )
    if len(prompt) > MAX_PROMPTS:
        raise bad("prompt", f"got {len(prompt)} prompts; at most {MAX_PROMPTS} per request")
    names = ["prompt"] if len(prompt) == 1 else [f"prompt[{i}]" for i in range(len(prompt))]
    ids = [encode(p, name) if isinstance(p, str) else list(p) for p, name in zip(prompt, names, strict=True)]
    for p, name in zip(ids, names, strict=True):
        check_prompt_ids(p, vocab, window, name)
    logprobs = integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    options = _options(body)
    return Job(
        chat=False,
        prompts=ids,
        max_tokens=integer(body, "max_tokens", 16, 0),
        logprobs=logprobs,
        echo=boolean(body, "echo"),
        prompt_texts=[p if isinstance(p, str) else decode(p) for p in prompt],
        **options,
    )


def render_chat(messages: object) -> str:
    """The documented chat template (module docstring). Raises :class:`APIError` for bad messages."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "it must be a non-empty list of {role, content} objects")
    lines = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or message["role"] not in CHAT_ROLES
        ):
            raise bad(where, f"each message needs a role, one of {', '.join(CHAT_ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise bad(f"{where}.content", "only text parts ({type: text, text}) are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"got {content!r}; it must be a string or a list of text parts")
        lines.append(f"{CHAT_ROLES[message['role']]}: {content}")
    return "\n".join(lines) + "\nAssistant:"


def parse_chat(body: object, *, encode: Callable[..., list[int]], vocab: int, window: int) -> Job:
    """Check a ``/v1/chat/completions`` body; the messages are rendered with :func:`render_chat`.
    ``max_completion_tokens`` (or ``max_tokens``) defaults to the rest of the window."""
    body = check_fields(body, CHAT_FIELDS)
    text = render_chat(body.get("messages"))
    ids = encode(text, "messages")
    check_prompt_ids(ids, vocab, window, "messages")
    top = integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and body.get("logprobs") is not True:
        raise bad("top_logprobs", "it needs logprobs: true")
    limit = integer(body, "max_completion_tokens", None, 0)
    old_limit = integer(body, "max_tokens", window, 0)  # checked even when max_completion_tokens is given
    limit = old_limit if limit is None else limit
    return Job(
        chat=True,
        prompts=[ids],
        max_tokens=limit,
        logprobs=(top or 0) if boolean(body, "logprobs") else None,
        echo=False,
        prompt_texts=[text],
        **_options(body),
    )
