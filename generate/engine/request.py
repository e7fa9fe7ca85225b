"""A request: one prompt with its own sampling settings, and what it has generated so far."""

from __future__ import annotations

import numbers
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from generate.engine.sampling import SamplingParams
from generate.engine.text import TextTracker


def check_seed(seed: object) -> int | None:
    """Return ``seed`` as an int (None stays None); ValueError unless it is an integer in 0..2**64-1."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**64:
        raise ValueError(f"seed={seed!r} is out of range; a seed must be an integer in 0..2**64-1, or None")
    return int(seed)


def check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop`` (None, a string, a list or tuple of them) as a tuple; ValueError for anything else, an empty
    string or one with a lone surrogate."""
    stop = (stop,) if isinstance(stop, str) else () if stop is None else stop
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if any("\ud800" <= c <= "\udfff" for c in s):
            raise ValueError(f"stop string {s!r} holds a lone surrogate, which no text can contain")
    return tuple(stop)


def check_prompt(prompt: Sequence[int], vocab: int, window: int) -> None:
    """ValueError unless ``prompt`` is 1 to ``window - 1`` token ids, integers in ``0..vocab-1``."""
    if len(prompt) == 0:
        raise ValueError("the prompt has no tokens; start it with <|endoftext|> (id 50256) for none")
    if len(prompt) >= window:
        raise ValueError(f"the prompt has {len(prompt)} tokens but the model's window is {window} "
                         f"positions, which leaves room for at most {window - 1} prompt tokens; shorten the "
                         "prompt")  # fmt: skip
    if bad := [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)]:
        raise ValueError(f"the prompt has token id {bad[0]!r}, which is not an integer; token ids are ints")
    if bad := [t for t in prompt if not 0 <= t < vocab]:
        raise ValueError(f"the prompt has token id {bad[0]} outside the vocabulary 0..{vocab - 1}")


def make_requests(prompts: Sequence[Sequence[int]], seed: int | Sequence[int | None] | None, vocab: int,
                  window: int, **fields: object) -> list[Request]:  # fmt: skip
    """One :class:`Request` per prompt, all checked before any runs: ``seed`` is one for all or one per
    prompt; ``fields`` are the other :class:`Request` fields. An error names a bad prompt (``prompt i``)."""
    if not prompts:
        raise ValueError("no prompts given; pass at least one")
    seed = seed.tolist() if hasattr(seed, "tolist") else seed  # (a numpy array or integer as Python's)
    seeds = list(seed) if isinstance(seed, Sequence) else [seed] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts; pass one per prompt")
    requests = [Request(list(p), seed=s, **fields) for p, s in zip(prompts, seeds, strict=True)]
    for i, r in enumerate(requests):
        try:
            check_prompt(r.prompt, vocab, window)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    return requests


def check_max_new_tokens(value: object) -> int:
    """Return ``value`` as an int; ValueError unless it is an integer >= 0."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {value!r}")
    return int(value)


@dataclass(eq=False)  # a request is itself: the engine finds it by identity, never by equal fields
class Request:
    """One prompt (token ids) and how to continue it; the engine fills in the results (from ``token_ids``).
    ``max_new_tokens``, the engine's ``max_len``, ``eos_id`` (None: never early) and ``stop`` strings (with
    the engine's tokenizer) end it. ``seed`` (None: a random one each run) fixes its draws whatever else runs.
    ``logprobs`` records each chosen token's log-probability under the model's own distribution;
    ``top_logprobs``, that many most likely alternatives' (id -> logprob)."""

    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 64
    seed: int | None = None
    eos_id: int | None = 50256
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs_list: list[float] = field(default_factory=list)
    top_list: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length" (budget or window)
    text: TextTracker | None = None
    error: str | None = None  # why the engine ended it, with finish_reason "error"

    def __post_init__(self) -> None:
        self.prompt = list(self.prompt)
        self.max_new_tokens = check_max_new_tokens(self.max_new_tokens)
        self.seed = check_seed(self.seed)
        self.stop = check_stop(self.stop)
        top = self.top_logprobs
        if isinstance(top, bool) or not isinstance(top, numbers.Integral) or not 0 <= top <= 20:
            raise ValueError(f"top_logprobs must be an integer in 0..20, got {top!r}")
        if self.logprobs not in (True, False):  # (a string would read as true)
            raise ValueError(f"logprobs must be True or False, got {self.logprobs!r}")

    @property
    def done(self) -> bool:
        """Whether the request has finished."""
        return self.finish_reason is not None

    def start(self, token_bytes: Callable[[int], bytes] | None) -> int:
        """Reset the results (a request can be run again); return the seed of its draws, ``drawn_seed``."""
        self.token_ids, self.logprobs_list, self.top_list = [], [], []
        self.finish_reason = self.error = None
        if token_bytes is not None:
            self.text = TextTracker(token_bytes, self.stop)
        elif self.stop:
            raise ValueError("stop strings need the engine to have a tokenizer; pass token_bytes=")
        self.drawn_seed = secrets.randbits(64) if self.seed is None else self.seed
        return self.drawn_seed

    def record(self, token: int, window: int) -> None:
        """Append a chosen token; finish the request if it ends one (EOS, a stop string, budget, window)."""
        self.token_ids.append(token)
        if token == self.eos_id or (self.text is not None and self.text.add(token)):
            self.finish("stop")
        elif len(self.token_ids) >= self.max_new_tokens or len(self.prompt) + len(self.token_ids) >= window:
            self.finish("length")
        if self.text is not None and self.text.stopped:
            self.finish("stop")  # the token that spent the budget completed a stop string: the text says stop

    def finish(self, reason: str) -> None:
        """Mark the request finished; ``"stop"`` also replaces ``"length"`` (see :meth:`record`)."""
        if self.finish_reason is None or (self.finish_reason == "length" and reason == "stop"):
            self.finish_reason = reason
        if self.text is not None:
            self.text.close()
