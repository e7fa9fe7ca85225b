"""Speculative decoding: proposals checked in one step, exact by construction.

A speculating engine's step feeds every slot ``1 + lookahead`` tokens at consecutive positions: its last
token, then the tokens a proposer guesses will follow (the rest padding). The step's logits at each position
are the model's, and the engine chooses a token from them exactly as in a plain step (a sampled token is a
fixed function of the logits, the seed and the position: :func:`generate.engine.sampling.uniform`); it goes
on to the next position only while the chosen token equals the proposal there. So the tokens are those the
engine gives with no proposals at all, whatever was proposed; proposals only decide how many come per step.

Every step has the same shape, and its attention sums over the cache in fixed chunks as a decode step's does
(the same bits over any span), so a row's bits depend on that row alone, as in a plain engine. The shape
differs from a plain step's ``(slots, 1)``, so the logits may differ from a plain
engine's in the last bits (within the prefix tests' tolerance), and a near-tie can pick another token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from generate.engine.request import Request
from model import GPT, KVCache

DEFAULT_LOOKAHEAD = 4


class Proposer(Protocol):
    """Guesses the tokens that follow a request's prompt and output so far."""

    def propose(self, slot: int, request: Request, k: int) -> list[int]:
        """At most ``k`` tokens that may follow ``request.prompt + request.token_ids`` (in ``slot``)."""
        ...


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the last ``n`` tokens (of the
    prompt and output), trying ``n``, then shorter tails down to one token.

    Args:
        n: the longest tail matched.
    """

    def __init__(self, n: int = 3) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r} must be a positive integer (the longest tail matched)")
        self.n = n

    def propose(self, slot: int, request: Request, k: int) -> list[int]:
        """See :class:`Proposer`."""
        history = request.prompt + request.token_ids
        last = len(history) - 1
        for size in range(min(self.n, last), 0, -1):
            tail = history[-size:]
            for end in range(last - 1, size - 2, -1):  # the latest earlier match first
                if history[end] == tail[-1] and history[end - size + 1 : end + 1] == tail:
                    return history[end + 1 : end + 1 + k]
        return []


class DraftProposer:
    """A draft model sharing the tokenizer guesses greedily, over a KV cache of its own (a slot per engine
    slot). It keeps the keys and values of what it was fed while they still match the request's tokens, so
    each step feeds only what is new: the tokens chosen since, then its own guesses.

    Args:
        model: the draft (eval mode), on the target's device.
        slots: the engine's slot count.
    """

    def __init__(self, model: GPT, slots: int) -> None:
        self.model = model.eval()
        window = model.config.n_positions
        self.cache = KVCache(model.config, slots, window, dtype=model.compute_dtype, device=model.device)
        self.fed: list[list[int]] = [[] for _ in range(slots)]  # the tokens each slot's cache holds
        self.owner: list[Request | None] = [None] * slots

    @torch.inference_mode()
    def propose(self, slot: int, request: Request, k: int) -> list[int]:
        """See :class:`Proposer`; nothing past the draft's own window."""
        history = request.prompt + request.token_ids
        k = min(k, self.model.config.n_positions - len(history))
        if k <= 0:
            return []
        if self.owner[slot] is not request:
            self.cache.clear(slot)
            self.fed[slot], self.owner[slot] = [], request
        fed = self.fed[slot]
        same = next((i for i, (a, b) in enumerate(zip(fed, history, strict=False)) if a != b), len(fed))
        del fed[min(same, len(history) - 1) :]  # (at least the last token is fed again: its logits)
        new, proposals = history[len(fed) :], []
        for _ in range(k):
            device = self.model.device
            positions = torch.arange(len(fed), len(fed) + len(new), device=device)[None]
            logits = self.model(torch.tensor([new], device=device), positions=positions, cache=self.cache,
                                slot=slot, span=len(fed) + len(new), last_only=True)  # fmt: skip
            fed += new
            new = [int(logits[0, -1].argmax())]
            proposals.append(new[0])
        return proposals


@dataclass
class Counts:
    """Speculation's counts: proposals made and accepted, verifying passes (a slot's step) and the tokens
    they gave."""

    proposed: int = 0
    accepted: int = 0
    passes: int = 0
    tokens: int = 0

    def stats(self) -> dict[str, float]:
        """The counts, the acceptance rate and the tokens per pass."""
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "passes": self.passes,
            "tokens": self.tokens,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "tokens_per_pass": self.tokens / self.passes if self.passes else 0.0,
        }


def make_speculator(
    draft: GPT | str, slots: int, lookahead: int = DEFAULT_LOOKAHEAD, counts: Counts | None = None
) -> Speculator:
    """A :class:`Speculator` for an engine of ``slots``: ``draft`` is ``"ngram"`` (prompt lookup) or a
    draft model; ``counts`` are added to (default: its own)."""
    if isinstance(draft, str):
        if draft != "ngram":
            raise ValueError(
                f"draft={draft!r}: give 'ngram' or a draft model (a checkpoint sharing the tokenizer)"
            )
        return Speculator(NgramProposer(), lookahead, counts)
    return Speculator(DraftProposer(draft, slots), lookahead, counts)


class Speculator:
    """What a speculating engine keeps: the proposer, each slot's lookahead, and counts for metrics.

    Each slot proposes at most ``lookahead`` tokens; after a step it proposes one more than it had accepted
    (up to ``lookahead``), so a request whose proposals fail proposes one token a step.

    Args:
        proposer: where proposals come from.
        lookahead: the most tokens proposed per slot and step (the step's width is one more).
        counts: where its counts are added (default: its own).
    """

    def __init__(
        self, proposer: Proposer, lookahead: int = DEFAULT_LOOKAHEAD, counts: Counts | None = None
    ) -> None:
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or not 1 <= lookahead <= 16:
            raise ValueError(f"lookahead={lookahead!r} must be an integer in 1..16")
        self.proposer, self.lookahead = proposer, lookahead
        self.ahead: dict[int, int] = {}  # slot -> how many it proposes next
        self.counts = Counts() if counts is None else counts

    def inputs(
        self, pending: torch.Tensor, lengths: list[int], running: dict[int, Request], window: int, vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, list[int]]]:
        """A step's (slots, 1 + lookahead) tokens and positions, and each running slot's proposals.

        Row ``s`` feeds its pending token at ``lengths[s]`` and its proposals after it. A proposal stays below
        position ``window - 1`` (the last position is only ever chosen, never fed) and within the request's
        budget; padding goes at the next positions, the ones past ``window - 2`` all at ``window - 1``, which
        no query reads. Proposals end before an id outside ``0..vocab-1``, which no step can choose.
        """
        width = 1 + self.lookahead
        tokens = torch.zeros(len(lengths), width, dtype=torch.long)
        tokens[:, 0] = pending
        positions = (torch.tensor(lengths)[:, None] + torch.arange(width)).clamp_(max=window - 1)
        proposals = {}
        for slot, request in running.items():
            left = request.max_new_tokens - len(request.token_ids) - 1
            k = min(self.ahead.setdefault(slot, self.lookahead), window - 2 - lengths[slot], left)
            proposed = [int(t) for t in self.proposer.propose(slot, request, k)[:k]] if k > 0 else []
            outside = next((i for i, t in enumerate(proposed) if not 0 <= t < vocab), len(proposed))
            proposals[slot] = proposed[:outside]
            tokens[slot, 1 : 1 + len(proposals[slot])] = torch.tensor(proposals[slot], dtype=torch.long)
        return tokens, positions, proposals

    def record(self, slot: int, proposed: int, chosen: int) -> None:
        """Count a slot's step (``chosen`` tokens from ``proposed`` proposals) and set its next lookahead."""
        accepted = max(chosen - 1, 0)
        self.counts.proposed += proposed
        self.counts.accepted += accepted
        self.counts.passes += 1
        self.counts.tokens += chosen
        self.ahead[slot] = min(self.lookahead, accepted + 1)

    def stats(self) -> dict[str, float]:
        """See :meth:`Counts.stats`."""
        return self.counts.stats()
