"""The token-level API: :func:`generate_ids` runs token id prompts through an engine."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

from generate.engine.engine import Engine, raise_errors
from generate.engine.request import make_requests
from generate.engine.sampling import SamplingParams
from model import GPT


@dataclass
class TokenCompletion:
    """What one prompt generated: token ids (EOS included if it came), why it stopped, log-probabilities."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS) or "length" (budget or window)
    logprobs: list[float] | None = None


def generate_ids(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 64,
    sampling: SamplingParams | None = None,
    seed: int | Sequence[int | None] | None = None,
    eos_id: int | None = 50256,
    logprobs: bool = False,
    slots: int | None = None,
    compile: bool = False,
) -> list[TokenCompletion]:
    """Generate from token id prompts; the token-level API.

    Args:
        model: the model (eval mode).
        prompts: non-empty token id lists of any lengths.
        max_new_tokens: the most tokens per prompt.
        sampling: how tokens are chosen (default: ``SamplingParams()``, temperature 1).
        seed: one seed for every prompt (a prompt's draws are a function of the seed and each token's
            position, so its output does not depend on the others), a sequence of per-prompt seeds, or None.
        eos_id: the end-of-text id that ends a prompt's output (None: never).
        logprobs: also return each chosen token's log-probability.
        slots: how many prompts run at once (default all of them).
        compile: run the decode step compiled.

    Returns:
        One :class:`TokenCompletion` per prompt, in order.

    Example:
        >>> generate_ids(model, [[464, 3290]], max_new_tokens=5, sampling=SamplingParams(temperature=0))
        ... # doctest: +SKIP
    """
    _check(model, prompts, sampling, eos_id, slots, compile)
    # (a numpy array or tensor, 2-D or of rows, as Python lists: what they hold is checked as a list's)
    prompts = prompts.tolist() if hasattr(prompts, "tolist") else [p.tolist() if hasattr(p, "tolist") else p
                                                                   for p in prompts]  # fmt: skip
    cfg, sampling = model.config, sampling or SamplingParams()
    requests = make_requests(prompts, seed, cfg.vocab_size, cfg.n_positions, sampling=sampling,
                             max_new_tokens=max_new_tokens, eos_id=eos_id, logprobs=logprobs)  # fmt: skip
    longest = max(len(r.prompt) for r in requests) + max(1, requests[0].max_new_tokens)
    max_len = min(model.config.n_positions, longest)
    engine = Engine(
        model, slots=len(prompts) if slots is None else int(slots), max_len=max_len, compile=compile
    )
    for r in requests:
        engine.add(r)
    for _ in engine.run():
        pass
    raise_errors(requests)
    return [
        TokenCompletion(r.token_ids, r.finish_reason, r.logprobs_list if logprobs else None) for r in requests
    ]


def _check(
    model: object, prompts: object, sampling: object, eos_id: object, slots: object, compile: object
) -> None:
    """ValueError naming the first of :func:`generate_ids`' arguments of the wrong kind or out of range."""
    if not isinstance(model, GPT):
        raise ValueError(
            f"model must be a model.GPT, got {type(model).__name__} (a Generator's is gen.model)"
        )

    def listed(x: object) -> bool:  # (a list, tuple or numpy array; not a string)
        return hasattr(x, "__len__") and hasattr(x, "__iter__") and not isinstance(x, (str, bytes))

    if not listed(prompts) or not all(listed(p) for p in prompts):
        raise ValueError("prompts must be a list of token id lists, such as [[464, 3290]]; encode text first")
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    integral = isinstance(eos_id, numbers.Integral) and not isinstance(eos_id, bool)
    if eos_id is not None and (not integral or eos_id < 0):
        raise ValueError(f"eos_id={eos_id!r} must be a token id (an integer >= 0), or None for none")
    if slots is not None and (
        isinstance(slots, bool) or not isinstance(slots, numbers.Integral) or slots < 1
    ):
        raise ValueError(f"slots={slots!r} must be an integer >= 1, or None for one per prompt")
    if compile not in (True, False):
        raise ValueError(f"compile={compile!r} must be True or False")
