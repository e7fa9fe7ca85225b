"""The engine: slots that requests join and leave, one decode step at a time for all of them.

Prompts are prefilled alone, cut at fixed positions, and every step computes every slot with fixed shapes, so
a request's bits do not depend on who shares the engine, when or for how long (docs/engine.md says why)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator

import torch

from generate.engine.memory import check_engine_memory, out_of_memory, said_plainly
from generate.engine.request import Request, check_prompt
from generate.engine.runner import Runner
from generate.engine.sampling import BLOCK, argmax_rows, sample_row, uniform
from generate.engine.speculate import Speculator
from model import GPT, KVCache


class GenerationError(RuntimeError):
    """A request could not be continued (NaN or infinite logits; sampling or decoding failed)."""


def raise_errors(requests: list[Request]) -> None:
    """Raise :class:`GenerationError` with the first of ``requests`` that ended with an error, if any."""
    for r in requests:
        if r.finish_reason == "error":
            raise GenerationError(r.error)


# Prompt positions a step prefills at most beside other slots, cut at multiples: a prompt's bits are its own.
PREFILL_CHUNK = 32
OUT_OF_MEMORY_ADVICE = "run fewer requests at once, fewer new tokens, a shorter prompt or a smaller dtype"
NOT_FINITE_ADVICE = "the checkpoint may be corrupt, or float16 overflowed (try dtype='float32' or 'bfloat16')"


class Engine:
    """Runs requests in a fixed set of ``slots`` (the rows of every step) with ``model`` (in eval mode).

    Args:
        max_len: positions per slot, where a request ends (``"length"``); default and compiled: the window.
        token_bytes: maps a token id to its bytes (the tokenizer's), for stop strings and text.
        vocab_limit: choose only ids below this (a tokenizer smaller than a padded vocabulary).
        compile: run the decode step compiled; ``progress`` is then called with lines of text as it goes.
        speculate: check proposed tokens in each step (:mod:`generate.engine.speculate`).

    A request whose logits are not finite, or whose sampling or text fails, ends alone (``"error"``, its
    ``error`` says why); the others go on unchanged. ValueError for ``slots`` or ``max_len`` out of range;
    MemoryError (checked first) where cache and working memory do not fit. ``max_len`` changes no bits."""

    def __init__(self, model: GPT, *, slots: int = 8, max_len: int | None = None,
                 token_bytes: Callable[[int], bytes] | None = None, vocab_limit: int | None = None,
                 compile: bool = False, progress: Callable[[str], None] | None = None,
                 speculate: Speculator | None = None) -> None:  # fmt: skip
        cfg, window = model.config, model.config.n_positions
        max_len = window if max_len is None else max_len
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive integer, got {slots!r}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or not 2 <= max_len <= window:
            raise ValueError(f"max_len must be an integer in 2..{window} (the window), got {max_len!r}")
        if compile:  # one compiled step serves every length: its cache holds the whole window
            max_len = window
        check_engine_memory(cfg, slots, max_len, model.compute_dtype, model.device)
        self.model, self.token_bytes, self.speculator = model, token_bytes, speculate
        self.vocab = cfg.vocab_size if vocab_limit is None else min(vocab_limit, cfg.vocab_size)
        with said_plainly(OUT_OF_MEMORY_ADVICE):  # (past the up-front check when memory shrank meanwhile)
            self.cache = KVCache(cfg, slots, max_len, dtype=model.compute_dtype, device=model.device)
            width = 1 if speculate is None else 1 + speculate.lookahead  # (a lone slot: plain steps too)
            self.runner = Runner(model, self.cache, compile=compile, progress=progress,
                                 widths=(width,) if slots > 1 else (1, width))  # fmt: skip
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        # request -> once it runs, its penalties' state (a request is hashed by identity)
        self._state: dict[Request, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self._prefilling: dict[int, int] = {}  # slot -> prompt positions written so far, in joining order
        self._pending = torch.zeros(slots, dtype=torch.long)  # each slot's token to feed next (0 when idle)
        self.chunk = PREFILL_CHUNK if slots > 1 else max_len  # (a lone slot stalls no one: one pass a prompt)

    @property
    def slots(self) -> int:
        """How many requests run at once."""
        return self.cache.slots

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> Request:
        """Queue a request (checked now); it joins a free slot at the next :meth:`step`. Returns it."""
        check_prompt(request.prompt, self.model.config.vocab_size, self.cache.max_len)
        request.start(self.token_bytes)  # results reset and the seed fixed once, here
        if request.max_new_tokens == 0:
            request.finish("length")
        else:
            self._state[request] = (None, None)
            self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request wherever it is (waiting or running) and free its slot."""
        if request in self.waiting:
            self.waiting.remove(request)
            self._state.pop(request, None)
        for slot in [s for s, r in self.running.items() if r is request]:
            self._free(slot)
        request.finish("cancelled")

    @torch.inference_mode()
    @said_plainly(OUT_OF_MEMORY_ADVICE)
    def step(self) -> list[tuple[Request, int]]:
        """Admit waiting requests into free slots, then advance each running one by a token (or more,
        accepting proposals): (request, token) per token chosen, in slot order. Out of memory: MemoryError."""
        free = [s for s in range(self.slots) if s not in self.running]
        for slot in free[: len(self.waiting)]:
            self.cache.clear(slot)
            self.running[slot], self._prefilling[slot] = self.waiting.popleft(), 0
            if self.speculator is not None:  # (a request that ended in its step left its lookahead there)
                self.speculator.ahead.pop(slot, None)
        budget, joined = self.chunk, {}  # slot -> the last logits of a prompt prefilled whole
        for slot, start in list(self._prefilling.items()):
            prompt = self.running[slot].prompt
            end = min(len(prompt), (start // self.chunk + 1) * self.chunk)
            if end - start > budget:  # (the step's first chunk always fits)
                break
            last = self.runner.prefill(prompt[start:end], slot, start)
            budget -= end - start
            self._prefilling[slot] = self.cache.lengths[slot] = end
            if end == len(prompt):
                del self._prefilling[slot]
                self._start_state(self.running[slot])
                joined[slot] = last
        rows = {slot: i for i, slot in enumerate(joined)}  # (their rows of the stacked logits)
        events = self._choose(torch.stack(list(joined.values())), rows) if joined else []
        # Every slot is computed (fixed shapes); a prefilling one at the position its next chunk rewrites.
        decoding = [slot for slot in self.running if slot not in self._prefilling]
        if decoding and self.speculator is not None:
            events += self._verify(decoding)
        elif decoding:
            logits = self.runner.decode(self._pending, torch.tensor(self.cache.lengths))
            for slot in decoding:
                self.cache.lengths[slot] += 1
            events += self._choose(logits, {slot: slot for slot in decoding})
        return events

    def _verify(self, decoding: list[int]) -> list[tuple[Request, int]]:
        """A speculating step (:mod:`generate.engine.speculate`). A lone slot feeds only what it proposed
        (a plain step where nothing) where its runner fits that width: no neighbour's bits depend on it."""
        spec, running = self.speculator, {slot: self.running[slot] for slot in decoding}
        tokens, positions, proposals = spec.inputs(self._pending, self.cache.lengths, running,
                                                   self.cache.max_len, self.vocab)  # fmt: skip
        lone, proposed = self.slots == 1, len(proposals[decoding[0]])  # (several slots: one width always)
        if lone and self.runner.fits(1 + proposed):  # (else padded: a lone compiled step of a library each)
            tokens, positions = tokens[:, : 1 + proposed], positions[:, : 1 + proposed]
        width = tokens.shape[1]  # nothing proposed (a width of 1): a plain step
        logits = self.runner.verify(tokens, positions)  # (slots, width, V)
        events = self._choose(logits.flatten(0, 1), {slot: slot * width for slot in decoding}, proposals)
        for slot, request in running.items():
            chosen = sum(1 for r, _ in events if r is request)
            spec.record(slot, len(proposals[slot]), chosen, len(request.token_ids) if lone else None)
            if self.running.get(slot) is request:
                self.cache.lengths[slot] += chosen
        return events

    def run(self) -> Iterator[list[tuple[Request, int]]]:
        """Step until no request is waiting or running, yielding each step's events."""
        while self.has_work:
            yield self.step()

    def _start_state(self, request: Request) -> None:
        if request.sampling.penalized:
            device = self.model.device  # (where the logits are)
            seen = torch.zeros(self.vocab, dtype=torch.bool, device=device)
            prompt = torch.tensor(request.prompt, device=device)
            seen[prompt[prompt < self.vocab]] = True
            counts = torch.zeros(self.vocab, dtype=torch.int32, device=device)
            self._state[request] = (seen, counts)

    def _choose(
        self, logits: torch.Tensor, rows: dict[int, int], proposals: dict[int, list[int]] | None = None
    ) -> list[tuple[Request, int]]:
        """Choose the next token of every slot in ``rows`` (slot -> its row of ``logits``, (N, V)); a slot
        with ``proposals`` goes on to the rows after its own while each token equals the proposal."""
        events = []
        # Every row at once: a finite sum means finite logits (one reduction; an overflowed sum is checked
        # exactly), and argmax has no order to differ in. Rows padded with -inf to whole blocks (argmax_rows),
        # aligned as a lone request's: a GPU's sum order depends on it.
        padded = logits.new_empty(len(logits), -(-self.vocab // BLOCK) * BLOCK, dtype=torch.float32)
        padded[:, self.vocab :], block = -math.inf, padded[:, : self.vocab]
        block.copy_(logits[:, : self.vocab])
        finite = [math.isfinite(total) for total in block.sum(-1).tolist()]
        sampling = {slot: self.running[slot].sampling for slot in rows}
        plain = {slot for slot, params in sampling.items() if params.greedy and not params.penalized}
        argmax = argmax_rows(padded).tolist() if plain else None
        for slot, first in rows.items():
            request = self.running[slot]
            for i, proposal in enumerate([*(proposals or {}).get(slot, ()), None], start=first):
                token = self._choose_row(slot, block[i], finite[i], argmax[i] if slot in plain else None)
                if token is None:
                    break
                events.append((request, token))
                self._pending[slot] = token
                if request.done:
                    self._free(slot)
                if request.done or token != proposal:
                    break
        return events

    def _choose_row(self, slot: int, row: torch.Tensor, finite: bool, chosen: int | None) -> int | None:
        """The slot's next token from its ``row`` of logits (recorded), or None where its request failed."""
        request = self.running[slot]
        if not finite and not torch.isfinite(row).all():
            self._fail(slot, f"the model produced NaN or infinite logits; {NOT_FINITE_ADVICE}")
            return None
        seed, (seen, counts) = request.drawn_seed, self._state[request]
        u = 0.0 if request.sampling.greedy else uniform(seed, len(request.prompt) + len(request.token_ids))
        try:
            token, logprob, top = sample_row(row, request.sampling, u, seen, counts, token=chosen,
                                             logprobs=request.logprobs, top=request.top_logprobs)  # fmt: skip
            if request.logprobs:
                request.logprobs_list.append(logprob)
            if top is not None:
                request.top_list.append(top)
            request.record(token, self.cache.max_len)
        except Exception as e:  # this request's alone (a tokenizer, a sampling bug): the others go on
            if out_of_memory(e, "") is not None:
                raise  # (the allocator's: step() says it plainly)
            self._fail(slot, f"its next token could not be chosen: {type(e).__name__}: {e}")
            return None
        return token

    def _fail(self, slot: int, message: str) -> None:
        request = self._free(slot)
        request.error = message
        request.finish("error")

    def _free(self, slot: int) -> Request:
        request = self.running.pop(slot)
        self._state.pop(request, None)
        self._prefilling.pop(slot, None)
        self._pending[slot] = self.cache.lengths[slot] = 0
        return request
