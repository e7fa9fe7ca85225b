"""Speculative decoding: proposals checked in one step, exact by construction (docs/engine.md). A step feeds
each slot its last token, then its proposals; the engine chooses as in a plain step while each choice equals
the proposal, so whatever is proposed, the tokens are those of no proposals."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from generate.engine.memory import check_engine_memory
from generate.engine.request import Request
from generate.engine.runner import Progress, Runner
from generate.engine.sampling import draw, uniform
from model import GPT, KVCache

DEFAULT_LOOKAHEAD = 4
COMPILED_LOOKAHEAD = 3  # the API's when compiled: a lone slot's step of 4 rows takes the GEMM template
MAX_REST = 64  # the longest a slot rests from proposing after its proposals missed (tokens)


class Proposer(Protocol):
    """Guesses the tokens that follow a request's prompt and output so far."""

    def propose(self, slot: int, request: Request, k: int) -> list[int]:
        """At most ``k`` tokens that may follow ``request.prompt + request.token_ids`` (in ``slot``)."""


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the last ``n`` tokens (of the
    prompt and output), trying ``n``, then shorter tails down to one token."""

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
    """A draft ``model`` (sharing the tokenizer) chooses as the request would, at its random numbers
    (penalties aside), over a KV cache of its own, a slot per engine slot, fed only what is new."""

    def __init__(self, model: GPT, slots: int, compile: bool = False, progress: Progress = None) -> None:
        self.model, window = model.eval(), model.config.n_positions
        check_engine_memory(model.config, slots, window, model.compute_dtype, model.device)  # (then compiles)
        self.cache = KVCache(model.config, slots, window, dtype=model.compute_dtype, device=model.device)
        self.runner = Runner(self.model, self.cache, compile=compile, progress=progress)
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
        for i in range(k):  # (at position p the request draws at uniform(seed, p): so does its draft)
            logits = self._feed(new, slot)
            u = 0.0 if request.sampling.greedy else uniform(request.drawn_seed, len(history) + i)
            fed += new  # (in place: the slot's record)
            new = [draw(logits.float(), request.sampling, u)]
            proposals.append(new[0])
        return proposals

    def _feed(self, tokens: list[int], slot: int) -> torch.Tensor:
        """``tokens`` into ``slot`` after what it holds: the last one's logits. Eager, or more than a pass's
        catch-up (its last proposal and the token after): a prefill; else the compiled step a token at a
        time, every slot at the position it writes next (others rewrite it)."""
        positions = [len(fed) for fed in self.fed]
        if len(tokens) > 2 or not self.runner.compiled:
            return self.runner.prefill(tokens, slot, positions[slot])
        for token in tokens:
            ids = [token if row == slot else 0 for row in range(len(positions))]
            logits = self.runner.decode(torch.tensor(ids), torch.tensor(positions))[slot]
            positions[slot] += 1
        return logits


@dataclass
class Counts:
    """Speculation's counts: proposals made and accepted, verifying passes (a slot's step), tokens."""

    proposed: int = 0
    accepted: int = 0
    passes: int = 0
    tokens: int = 0

    def stats(self) -> dict[str, float]:
        """The counts, the acceptance rate and the tokens per pass."""
        rate, per_pass = self.accepted / max(self.proposed, 1), self.tokens / max(self.passes, 1)
        return {**asdict(self), "acceptance_rate": rate, "tokens_per_pass": per_pass}


def make_speculator(draft: GPT | str, slots: int, lookahead: int = DEFAULT_LOOKAHEAD,
                    counts: Counts | None = None, *, compile: bool = False,
                    progress: Progress = None) -> Speculator:  # fmt: skip
    """A :class:`Speculator` for an engine of ``slots``: ``draft`` is ``"ngram"`` (prompt lookup) or a draft
    model (its one-token steps compiled with ``compile``); ``counts`` are added to (default: its own)."""
    if isinstance(draft, str) and draft != "ngram":
        raise ValueError(f"draft={draft!r}: give 'ngram' or a draft model (one sharing the tokenizer)")
    proposer = NgramProposer() if isinstance(draft, str) else DraftProposer(draft, slots, compile, progress)
    return Speculator(proposer, lookahead, counts)


class Speculator:
    """A speculating engine's ``proposer``, slots' lookaheads and ``counts``: a slot proposes one more token
    than it had accepted last (at most ``lookahead``); where proposing costs (a lone slot's step is plain
    without), after a miss it rests for 1, then 2, 4, ... up to :data:`MAX_REST` tokens, then tries one."""

    def __init__(
        self, proposer: Proposer, lookahead: int = DEFAULT_LOOKAHEAD, counts: Counts | None = None
    ) -> None:
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or not 1 <= lookahead <= 16:
            raise ValueError(f"lookahead={lookahead!r} must be an integer in 1..16")
        self.proposer, self.lookahead = proposer, lookahead
        # slot -> (how many it proposes, the output length it rests until, misses in a row)
        self.ahead: dict[int, tuple[int, int, int]] = {}
        self.counts = Counts() if counts is None else counts

    def inputs(
        self, pending: torch.Tensor, lengths: list[int], running: dict[int, Request], window: int, vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, list[int]]]:
        """A step's (slots, 1 + lookahead) tokens and positions, and each running slot's proposals: row ``s``
        feeds its pending token at ``lengths[s]``, then proposals within the request's budget, below position
        ``window - 1`` (only ever chosen, never fed) and before any id outside ``0..vocab-1``; padding past
        ``window - 2`` sits at ``window - 1``, which no query reads."""
        width, proposals = 1 + self.lookahead, {}
        rows = [[token] + [0] * self.lookahead for token in pending.tolist()]
        positions = (torch.tensor(lengths)[:, None] + torch.arange(width)).clamp_(max=window - 1)
        for slot, request in running.items():
            left = request.max_new_tokens - len(request.token_ids) - 1
            ahead, rests_until, _ = self.ahead.get(slot, (self.lookahead, 0, 0))
            k = min(ahead if len(request.token_ids) >= rests_until else 0, window - 2 - lengths[slot], left)
            proposed = [int(t) for t in self.proposer.propose(slot, request, k)[:k]] if k > 0 else []
            outside = next((i for i, t in enumerate(proposed) if not 0 <= t < vocab), len(proposed))
            proposals[slot] = proposed[:outside]
            rows[slot][1 : 1 + outside] = proposals[slot]
        return torch.tensor(rows), positions, proposals

    def record(self, slot: int, proposed: int, chosen: int, made: int | None) -> None:
        """Count a slot's step (``chosen`` tokens from ``proposed`` proposals) and set its next lookahead;
        ``made``: the request's output length where proposing costs (a lone slot: a miss rests), or None."""
        accepted = max(chosen - 1, 0)
        self.counts.proposed += proposed
        self.counts.accepted += accepted
        self.counts.passes += 1
        self.counts.tokens += chosen
        misses = self.ahead.get(slot, (0, 0, 0))[2]
        if accepted:
            self.ahead[slot] = (min(self.lookahead, accepted + 1), 0, 0)
        elif proposed:  # a miss; where proposing costs, a rest
            self.ahead[slot] = (1, 0 if made is None else made + min(2**misses, MAX_REST), misses + 1)

    def stats(self) -> dict[str, float]:
        """See :meth:`Counts.stats`."""
        return self.counts.stats()
