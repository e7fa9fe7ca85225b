"""Sampling: parameters, logit processing (penalties, temperature, top-k, top-p, min-p) and token choice. A
token is a fixed function of the row's logits, its request's seed and the token's position (:func:`uniform`;
no generator carries state), so speculation's verification chooses exactly as a plain step. Top-p draws by
rejection (:func:`draw`), sorting nothing: a kept token has its filtered-softmax probability (in float32)."""

from __future__ import annotations

import math
import numbers
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

MASK64 = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15
BLOCK = 256  # a draw picks a block of this many ids, then an id in it (about the square root of a vocabulary)


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that spreads every input bit over the output."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) a request with ``seed`` samples its token at ``position`` with: 53 bits
    of a counter-based hash of the two (splitmix64 over the seed, then over the position added to it)."""
    return _unit(_mix64((seed + GOLDEN) & MASK64) + (position + 1) * GOLDEN)


def _unit(x: int) -> float:
    """A number in [0, 1): the top 53 bits of splitmix64 of ``x`` (taken modulo 2**64)."""
    return (_mix64(x & MASK64) >> 11) * 2.0**-53


_VALID = {  # each field: whether a finite value is in range, and what it must be
    "temperature": (lambda v: v >= 0, ">= 0 (0 means greedy)"),
    "top_k": (lambda v: isinstance(v, numbers.Integral) and v >= 0, "an integer >= 0 (0 disables it)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1] (1 disables it)"),
    "min_p": (lambda v: 0 <= v < 1, "in [0, 1) (0 disables it)"),
    "repetition_penalty": (lambda v: v > 0, "> 0 (1 disables it)"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2] (0 disables it)"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2] (0 disables it)"),
}


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits, in this order (ValueError for a value out of range; the
    defaults disable each): ``repetition_penalty`` divides the positive logits of tokens in the prompt or
    output and multiplies the negative ones (CTRL / Hugging Face); ``presence_penalty`` and
    ``frequency_penalty`` are subtracted from an output token's logit, once / per occurrence; ``temperature``
    divides the logits (0: greedy); ``top_k`` keeps that many most likely tokens, ``top_p`` the fewest most
    likely whose probabilities add up to it, ``min_p`` those at least it times the top probability."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        for name, (ok, valid) in _VALID.items():
            value = getattr(self, name)
            try:  # a real number a float can hold (10**400 is not)
                finite = type(value) is not bool and isinstance(value, numbers.Real) and math.isfinite(value)
            except OverflowError:
                finite = False
            if not finite:
                shown = repr(value)
                shown = shown if len(shown) <= 40 else f"{shown[:20]}...({len(shown)} characters)"
                raise ValueError(f"{name}={shown} is not a finite number; {name} must be {valid}")
            if not ok(value):
                raise ValueError(f"{name}={value!r} is out of range; {name} must be {valid}")
            # (a Fraction, a numpy float: stored as a plain float or int)
            object.__setattr__(self, name, int(value) if name == "top_k" else float(value))

    @property
    def penalized(self) -> bool:
        """Whether any penalty is active (else the token history need not be tracked)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """Whether the choice is the argmax."""
        return self.temperature == 0


def apply_penalties(
    logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """The (B, V) ``logits`` with the repetition penalty on the ``seen`` tokens (prompt or output) and the
    presence and frequency penalties by the output ``counts`` (``logits`` itself when none is active)."""
    if params.repetition_penalty != 1.0:
        penalty, limit = params.repetition_penalty, torch.finfo(logits.dtype).max
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        # (clamped: a tiny penalty can overflow a logit to infinity, and the softmax to NaN)
        logits = torch.where(seen, penalised, logits).clamp(-limit, limit)
    if params.presence_penalty != 0.0:
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    if params.frequency_penalty != 0.0:
        logits = logits - params.frequency_penalty * counts.to(logits.dtype)
    return logits


def _pick(weights: list[float], u: float) -> tuple[int, float]:
    """The index where the running sum of ``weights`` (float64, in order) passes ``u`` of their total, never
    one of weight 0, and the fraction of that weight ``u`` fell at (the number a draw inside it uses)."""
    cumulative = list(accumulate(weights))
    point = min(u * cumulative[-1], math.nextafter(cumulative[-1], 0.0))  # (rounding: never past the end)
    i = bisect_right(cumulative, point)
    return i, (point - (cumulative[i - 1] if i else 0.0)) / weights[i]


def _draw(probs: torch.Tensor, u: float) -> int:
    """The position in ``probs`` (V,) drawn at the uniform number ``u`` in proportion to its value, in two
    steps that write no buffer the size of V: a block of :data:`BLOCK` ids in proportion to its sum (float32),
    then an id inside it in proportion to its value; never a token of probability 0."""
    full = len(probs) - len(probs) % BLOCK
    sums = probs[:full].view(-1, BLOCK).sum(1).tolist()
    if full < len(probs):
        sums.append(float(probs[full:].sum()))
    block, v = _pick(sums, u)
    return block * BLOCK + _pick(probs[block * BLOCK : (block + 1) * BLOCK].tolist(), v)[0]


def argmax_rows(padded: torch.Tensor) -> torch.Tensor:
    """``padded.argmax(-1)`` of (N, W) rows, W a multiple of :data:`BLOCK` (padded with -inf), as a block's
    maximum, then inside the first block holding the row's: the same index (of a tie, a NaN: the first)."""
    blocks = padded.unflatten(1, (-1, BLOCK))
    first = blocks.amax(2).argmax(1)
    return first * BLOCK + blocks[torch.arange(len(padded), device=padded.device), first].argmax(1)


def draw(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """One row's token from its (V,) logits (penalties applied): the argmax when greedy, else a draw from the
    filtered softmax at the uniform number ``u``, by rejection: draw among the tokens top-k and min-p keep;
    keep the token when the tokens before it (most likely first, ties by lower id) hold less than ``top_p``
    of top-k's renormalised softmax, else draw again among those before it, at a number hashed from ``u``."""
    if params.greedy:
        return int(logits.argmax())
    top = logits.max()
    if params.temperature < torch.finfo(logits.dtype).tiny:  # (the limit: the top logits, ties shared, alone)
        ties = (logits == top).nonzero()[:, 0]
        return int(ties[_pick([1.0] * len(ties), u)[0]])
    # Shifted first: a tiny temperature then sends the others to -inf, not inf/inf. One buffer for all: right
    # after a step, whatever the draw writes is out of the caches.
    probs = logits.sub(top).div_(params.temperature)
    if 0 < params.top_k < len(probs):  # (ties with the k-th stay)
        probs.masked_fill_(probs < torch.topk(probs, params.top_k).values[-1], -math.inf)
    torch.softmax(probs, dim=-1, out=probs)
    support = probs if params.min_p == 0.0 else torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    for attempt in range(len(probs)):
        token = _draw(support, u)
        if params.top_p >= 1.0:
            return token
        p = float(probs[token])
        # The mass before it is at most the others' 1 - p, plus float32's error bound for summing n terms
        # twice (the softmax's, the mass's): a token above 1 - top_p by that bound is surely kept.
        if p > 1 - params.top_p + (len(probs) + 3) * 2.0**-22:
            return token
        above = float(F.threshold(probs, p, 0.0).sum())  # the tokens more likely; then ties of lower ids
        mass = above + int((probs[:token] == p).sum()) * p if above < params.top_p else above
        if mass < params.top_p or mass == 0:
            return token
        before = probs > p
        before[:token] |= probs[:token] == p
        support = torch.where(before, support, 0.0)
        u = _unit(int(u * 2.0**53) + attempt * GOLDEN)  # the next draw's number, hashed from this one
    raise AssertionError("unreachable: the most likely token is always kept")


def sample_row(logits: torch.Tensor, params: SamplingParams, u: float, seen: torch.Tensor | None = None,
               counts: torch.Tensor | None = None, *, token: int | None = None, logprobs: bool = False,
               top: int = 0) -> tuple[int, float | None, dict[int, float] | None]:  # fmt: skip
    """Choose one row's next token from its (V,) ``logits`` at the uniform number ``u`` (unused when greedy),
    or take the given ``token``, and add it to the row's penalty state ``seen`` and ``counts`` (None without
    penalties). Returns (token, its log-probability under the model's own distribution with ``logprobs``,
    the ``top`` most likely tokens' log-probabilities by id with ``top``), None for what was not asked."""
    tracked = seen is not None and counts is not None
    if token is None:
        row = apply_penalties(logits[None], seen[None], counts[None], params)[0] if tracked else logits
        token = draw(row, params, u)
    if tracked:
        seen[token] = True
        counts[token] += 1
    logprob = alternatives = None
    if logprobs or top:
        log_probs = torch.log_softmax(logits, dim=-1)
        logprob = float(log_probs[token])
        if top:
            values, ids = log_probs.topk(min(top, log_probs.shape[-1]))
            alternatives = dict(zip(ids.tolist(), values.tolist(), strict=True))
    return token, logprob, alternatives
