"""Sampling: parameters, logit processing (penalties, temperature, top-k, top-p, min-p) and token choice.

A sampled token is a fixed function of the row's logits, its request's seed and the token's position: one
uniform number, :func:`uniform` of the seed and the position, and the numbers hashed from it; nothing else is
drawn, and no generator carries state from one token to the next. So a token checked later (speculative
decoding's verification) is chosen exactly as it would have been in its own step.

Without top-k, top-p is sampled by rejection (:func:`_draw_nucleus`): a token is drawn from the whole
distribution (less what min-p drops) and kept when it lies in the nucleus, else the draw is repeated among
the tokens more likely than it. Each kept token then has exactly its filtered-softmax probability, and no
step sorts the vocabulary: with ``top_p=0.95`` the first draw is kept 95% of the time.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

MASK64 = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that spreads every input bit over the output."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) a request with ``seed`` samples its token at ``position`` with: 53 bits
    of a counter-based hash of the two (splitmix64 over the seed, then over the position added to it)."""
    key = _mix64((seed + GOLDEN) & MASK64)
    return (_mix64((key + (position + 1) * GOLDEN) & MASK64) >> 11) * 2.0**-53


def _again(u: float, attempt: int) -> float:
    """The uniform number of a draw repeated after ``attempt`` rejections, hashed from the first one ``u``."""
    return (_mix64((int(u * 2.0**53) + attempt * GOLDEN) & MASK64) >> 11) * 2.0**-53


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits.

    Processing order: repetition penalty, presence and frequency penalties, temperature, top-k, top-p, min-p.

    Attributes:
        temperature: 0 for greedy (argmax); otherwise logits are divided by it before sampling.
        top_k: keep the ``top_k`` most likely tokens; 0 keeps all.
        top_p: keep the smallest set of most likely tokens whose probability sum reaches ``top_p``.
        min_p: drop tokens less likely than ``min_p`` times the most likely token's probability.
        repetition_penalty: for tokens already in the prompt or output, positive logits are divided by it
            and negative ones multiplied (CTRL / Hugging Face); 1 disables.
        presence_penalty: subtracted once from the logit of every token the output already contains.
        frequency_penalty: subtracted from a token's logit once per time the output contains it.

    Raises:
        ValueError: on construction, for any value out of range; the message names it and the valid range.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        def finite(value: object) -> bool:  # a real number a float can hold (10**400 cannot)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                return False
            try:
                return math.isfinite(value)
            except OverflowError:
                return False

        def check(name: str, ok: bool, valid: str) -> None:
            value = getattr(self, name)
            if not finite(value):
                shown = f"{value!r}"
                shown = shown if len(shown) <= 40 else f"{shown[:20]}...({len(shown)} characters)"
                raise ValueError(f"{name}={shown} is not a finite number; {name} must be {valid}")
            if not ok:
                raise ValueError(f"{name}={value!r} is out of range; {name} must be {valid}")

        def number(name: str) -> float:
            value = getattr(self, name)
            return value if finite(value) else math.nan

        check("temperature", number("temperature") >= 0, ">= 0 (0 means greedy)")
        check(
            "top_k",
            isinstance(self.top_k, numbers.Integral) and self.top_k >= 0,
            "an integer >= 0 (0 disables it)",
        )
        check("top_p", 0 < number("top_p") <= 1, "in (0, 1] (1 disables it)")
        check("min_p", 0 <= number("min_p") < 1, "in [0, 1) (0 disables it)")
        check("repetition_penalty", number("repetition_penalty") > 0, "> 0 (1 disables it)")
        check("presence_penalty", -2 <= number("presence_penalty") <= 2, "in [-2, 2] (0 disables it)")
        check("frequency_penalty", -2 <= number("frequency_penalty") <= 2, "in [-2, 2] (0 disables it)")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):  # fmt: skip
            object.__setattr__(self, name, float(getattr(self, name)))  # (a Fraction, a numpy float)
        object.__setattr__(self, "top_k", int(self.top_k))

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
    """Apply the repetition, presence and frequency penalties.

    Args:
        logits: (B, V) float logits.
        seen: (B, V) bool, tokens in the prompt or the output so far (for the repetition penalty).
        counts: (B, V) output-token counts (for the presence and frequency penalties).
        params: the sampling parameters.

    Returns:
        The penalised logits (a new tensor when a penalty is active, else ``logits`` itself).
    """
    if params.repetition_penalty != 1.0:
        penalised = torch.where(
            logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
        )
        # A tiny penalty can overflow a logit to infinity; keep it finite so the softmax stays defined.
        limit = torch.finfo(logits.dtype).max
        logits = torch.where(seen, penalised, logits).clamp(-limit, limit)
    if params.presence_penalty != 0.0:
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    if params.frequency_penalty != 0.0:
        logits = logits - params.frequency_penalty * counts.to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Shift each row's top logit to 0, divide by the temperature, and set the logits of tokens top-k, top-p
    and min-p exclude to ``-inf`` (the shift leaves the distribution unchanged).

    Args:
        logits: (B, V) float logits (after penalties); ``params.temperature`` must be > 0.
        params: the sampling parameters.

    Returns:
        (B, V) logits; at least the most likely token of each row stays finite.
    """
    out = torch.full_like(logits, float("-inf"))
    for row, values in enumerate(logits):
        ids, kept = candidates(values, params)
        out[row, slice(None) if ids is None else ids] = kept
    return out


def candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens one row may draw, (n,) ids (None: every token), and their logits shifted and divided by
    the temperature.

    Each filter works on the tokens the one before kept: top-k, then top-p over their softmax, then min-p.
    Sampling comes here with top-k (a few candidates) or a tiny temperature; :func:`filter_logits` with
    anything (its top-p without top-k sorts the vocabulary).
    """
    # Shift the top logit to 0 first: a tiny temperature then sends the others to -inf, never to inf/inf. A
    # temperature below the dtype's smallest normal number (fp32: 1.2e-38) would round to 0 and make the top
    # logit 0/0: there the limit is taken directly, the top logits (ties shared) against -inf.
    top = logits.max()
    if params.temperature < torch.finfo(logits.dtype).tiny:
        ids = (logits == top).nonzero()[:, 0]
        return ids, torch.zeros(len(ids), dtype=logits.dtype, device=logits.device)
    scaled = (logits - top) / params.temperature
    ids = None
    if 0 < params.top_k < len(scaled):
        kth = torch.topk(scaled, params.top_k).values[-1]
        ids = (scaled >= kth).nonzero()[:, 0]  # (ties with the k-th stay)
    kept = scaled if ids is None else scaled[ids]
    if params.top_p < 1.0:
        chosen = _top_p(kept, params.top_p).sort().values  # (drawn in id order, as without top-k)
        ids, kept = (chosen if ids is None else ids[chosen]), kept[chosen]
    if params.min_p > 0.0:
        probs = torch.softmax(kept, dim=-1)
        chosen = (probs >= params.min_p * probs.max()).nonzero()[:, 0]
        ids, kept = (chosen if ids is None else ids[chosen]), kept[chosen]
    return ids, kept


def _top_p(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """The positions in ``scaled`` (n,) logits of the smallest set of most likely tokens (ties: lower
    positions first) whose probability sum reaches ``top_p``.

    A token is dropped when the tokens before it already reach ``top_p``; the first is always kept (a
    ``top_p`` below float32's smallest number rounds to 0, which the first token's 0 would reach). A sort:
    sampling reaches it with top-k's few candidates only (without top-k it draws by rejection instead)."""
    values, order = torch.softmax(scaled, dim=-1).sort(descending=True, stable=True)
    kept = (values.cumsum(0) - values) < top_p
    kept[0] = True
    return order[kept]


def _draw(probs: torch.Tensor, u: float) -> int:
    """The position of ``probs`` (n,) where its cumulative distribution, in id order and summed in float64,
    passes ``u`` (in [0, 1)) of its total; a token of probability 0 is never drawn (where rounding puts the
    point at the very end, the last token of positive probability is taken)."""
    cumulative = probs.cumsum(0, dtype=torch.float64)
    point = torch.tensor(u, dtype=torch.float64, device=probs.device) * cumulative[-1]
    i = int(torch.searchsorted(cumulative, point, right=True))
    return i if i < len(probs) else int((probs > 0).nonzero()[-1, 0])


def _draw_nucleus(probs: torch.Tensor, params: SamplingParams, u: float) -> int:
    """A token drawn from ``probs`` (V,) filtered by top-p then min-p, by rejection.

    Draw from the tokens min-p keeps (in id order, at ``u``). Keep the token when the tokens before it in the
    full sort's order (most likely first, ties by lower id) hold less than ``top_p`` (or there are none).
    Else it and every token after it are outside the nucleus: draw again among the tokens before it, at a
    number hashed from ``u``. A kept draw has exactly its filtered-softmax probability, and the first draw
    is kept with the nucleus' probability (``top_p`` or more), so most tokens take one draw."""
    support = probs
    if params.min_p > 0.0:
        support = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    for attempt in range(len(probs)):
        token = _draw(support, u)
        if params.top_p >= 1.0:
            return token
        p = probs[token]
        before, ties = probs > p, probs[:token] == p
        mass = torch.dot(probs, before.to(probs.dtype)) + ties.sum() * p
        if bool((mass < params.top_p) | (mass == 0)):
            return token
        before[:token] |= ties
        support, u = torch.where(before, support, 0.0), _again(u, attempt)
    raise AssertionError("unreachable: the most likely token is always kept")


def draw(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """One row's token from its processed logits (V,) (penalties applied): the argmax when greedy, else a
    draw from the filtered softmax at the uniform number ``u`` (:func:`uniform` of its seed and position)."""
    if params.greedy:
        return int(logits.argmax())
    if params.top_k == 0 and params.temperature >= torch.finfo(logits.dtype).tiny:
        return _draw_nucleus(torch.softmax((logits - logits.max()) / params.temperature, dim=-1), params, u)
    ids, kept = candidates(logits, params)
    drawn = _draw(torch.softmax(kept, dim=-1), u)
    return drawn if ids is None else int(ids[drawn])


def choose(logits: torch.Tensor, params: SamplingParams, uniforms: list[float]) -> torch.Tensor:
    """Pick one token per row (:func:`draw`), each at its own uniform number.

    Args:
        logits: (B, V) processed logits (penalties applied; temperature and filters not yet).
        params: the sampling parameters.
        uniforms: one number in [0, 1) per row (unused when greedy).

    Returns:
        (B,) int64 token ids.
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    return torch.tensor([draw(row, params, u) for row, u in zip(logits, uniforms, strict=True)],
                        device=logits.device)  # fmt: skip


def sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    u: float,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    *,
    token: int | None = None,
    logprobs: bool = False,
    top: int = 0,
) -> tuple[int, float | None, dict[int, float] | None]:
    """Choose one row's next token with that row's own settings, and update its penalty state.

    Args:
        logits: (V,) float logits of one row.
        params: the row's sampling parameters.
        u: the row's uniform number for this token (:func:`uniform`; unused when greedy).
        seen, counts: (V,) the row's penalty state (tokens in prompt or output; output counts), updated in
            place with the chosen token; None when no penalty is active.
        logprobs: also return the chosen token's log-probability under the model's own distribution.
        top: also return the ``top`` most likely tokens' log-probabilities (id -> log-probability).

    Returns:
        (token, log-probability or None, alternatives or None).
    """
    if token is None:
        row = logits[None]  # (1, V): the batch functions above, on one row
        if params.penalized and seen is not None and counts is not None:
            row = apply_penalties(row, seen[None], counts[None], params)
        token = draw(row[0], params, u)
    if seen is not None and counts is not None:
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
