"""The decode loop: prefill a left-padded batch once, then one token per step with a static KV cache."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from generate.sampling import SamplingParams, apply_penalties, choose
from model import GPT, GPTConfig, KVCache


class GenerationError(RuntimeError):
    """The model produced something that cannot be sampled from (NaN or infinite logits)."""


@dataclass
class TokenCompletion:
    """What one row generated: token ids (EOS included if it came), why it stopped, and log-probabilities."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length" (budget or window)
    logprobs: list[float] | None = None


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device`` (CPU: Linux's MemAvailable), or None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# Bytes per vocabulary entry of each row that a step holds at its peak: fp32 logits, penalty counts and flags,
# and sampling's temporaries (top-p sorts values and int64 indices, softmax, cumsum, masks). Measured here: a
# 512-row batch with top-p, a repetition penalty and logprobs raised peak RSS by 41 bytes per entry.
VOCAB_BYTES_PER_ROW = 48


def request_bytes(config: GPTConfig, batch: int, cache_len: int, prompt_len: int, dtype: torch.dtype) -> int:
    """Memory a request needs beyond the weights: the KV cache, per-row vocabulary-sized state (logits,
    penalty counts) and the prefill's activations (attention scores included)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    cache = KVCache.bytes_per_token(config, dtype) * batch * cache_len
    per_row_vocab = batch * config.vocab_size * VOCAB_BYTES_PER_ROW
    prefill = batch * prompt_len * (4 * config.inner_dim * itemsize + config.n_head * prompt_len * 4)
    return cache + per_row_vocab + prefill


def _check_memory(
    config: GPTConfig, batch: int, cache_len: int, prompt_len: int, dtype: torch.dtype, device: torch.device
) -> None:
    needed, free = request_bytes(config, batch, cache_len, prompt_len, dtype), available_memory(device)
    if free is not None and needed > free:
        raise MemoryError(
            f"this request needs about {needed / 2**20:,.0f} MiB ({batch} rows x {cache_len} positions of KV "
            f"cache, {KVCache.bytes_per_token(config, dtype):,} bytes each, plus working memory) but "
            f"only {free / 2**20:,.0f} MiB are available on {device}; use fewer prompts per batch "
            "or fewer new tokens"
        )


def check_seed(seed: object) -> int | None:
    """Return ``seed`` as an int (None stays None).

    Raises:
        ValueError: unless it is None or an integer (numpy integers too) in 0 .. 2**64 - 1.
    """
    if seed is None:
        return None
    try:
        value = operator.index(seed)
    except TypeError:
        value = -1
    if isinstance(seed, bool) or not 0 <= value < 2**64:
        raise ValueError(f"seed={seed!r} is out of range; a seed must be an integer in 0..2**64-1, or None")
    return value


def _generators(seeds: Sequence[int | None], device: torch.device) -> list[torch.Generator]:
    gens = []
    for seed in map(check_seed, seeds):
        g = torch.Generator(device=device)
        if seed is None:
            g.seed()  # nondeterministic
        else:
            g.manual_seed(seed)
        gens.append(g)
    return gens


class Decoder:
    """One batch of prompts being generated, a step at a time.

    Prompts of different lengths are left-padded; a per-row padding mask and position ids counted from each
    row's first real token make every row compute what it would alone. Rows finish independently; a
    finished row is no longer sampled and its output no longer changes.

    Args:
        model: the model (eval mode).
        prompts: token id lists, each non-empty and at most ``n_positions - 1`` long.
        max_new_tokens: the most tokens a row generates; a row also stops at the window's end.
        sampling: how tokens are chosen.
        seeds: one seed per row (None: nondeterministic); a row's draws depend only on its own seed.
        eos_id: the token that ends a row (None: never ends early).
        logprobs: record the log-probability of each chosen token under the model's distribution.
        vocab_limit: choose only ids below this (a tokenizer smaller than a vocabulary padded to a round
            size, e.g. 50257 of 50304); None: the whole vocabulary.

    Raises:
        ValueError: for an empty prompt, a token id outside the vocabulary, a prompt that leaves no room in
            the window, or a negative ``max_new_tokens``.
        MemoryError: if the request's cache and working memory exceed what the device has free; checked
            before anything is allocated.
    """

    def __init__(
        self,
        model: GPT,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingParams,
        seeds: Sequence[int | None],
        eos_id: int | None,
        logprobs: bool = False,
        vocab_limit: int | None = None,
    ) -> None:
        cfg = model.config
        _check_request(prompts, max_new_tokens, cfg.vocab_size, cfg.n_positions)
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts; pass one per prompt")
        self.model, self.sampling, self.eos_id = model, sampling, eos_id
        self.max_new_tokens = int(max_new_tokens)
        self.vocab = cfg.vocab_size if vocab_limit is None else min(vocab_limit, cfg.vocab_size)
        dtype, device = model.compute_dtype, model.device
        b, longest = len(prompts), max(len(p) for p in prompts)
        self.lengths = [len(p) for p in prompts]  # each row's own sequence length, padding excluded
        cache_len = min(cfg.n_positions, longest + max_new_tokens)
        _check_memory(cfg, b, cache_len, longest, dtype, device)
        self.cache = KVCache(cfg, b, cache_len, dtype=dtype, device=device)
        self.mask = torch.zeros(b, self.cache.max_len, dtype=torch.bool, device=device)
        self.padded = any(len(p) != longest for p in prompts)
        ids = torch.zeros(b, longest, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):  # left padding
            ids[i, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
            self.mask[i, longest - len(p) : longest] = True
        self.generators = _generators(seeds, device)
        self.rows = [TokenCompletion(logprobs=[] if logprobs else None) for _ in prompts]
        self.seen = torch.zeros(b, cfg.vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(b, cfg.vocab_size, dtype=torch.int32, device=device)
        for i, p in enumerate(prompts):
            self.seen[i, torch.tensor(p)] = True
        self.seen, self.counts = self.seen[:, : self.vocab], self.counts[:, : self.vocab]
        self._pending: torch.Tensor | None = None
        if max_new_tokens == 0:
            for row in self.rows:
                row.finish_reason = "length"
            return
        with torch.inference_mode():
            self._logits = self._forward(ids)  # prefill: the whole prompt in one call

    @property
    def done(self) -> bool:
        """Whether every row has finished."""
        return all(row.finish_reason is not None for row in self.rows)

    def finish(self, row: int, reason: str) -> None:
        """Mark a row finished (e.g. a stop string appeared in its text); it takes no further steps.

        ``"stop"`` also replaces ``"length"``: when the token that spent the budget completes a stop
        string, the text is cut by the stop string, so that is why it ended.
        """
        current = self.rows[row].finish_reason
        if current is None or (current == "length" and reason == "stop"):
            self.rows[row].finish_reason = reason

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        end = self.cache.length + ids.shape[1]
        # Without padding the mask is all ones: leaving it out lets attention skip building masks.
        mask = self.mask[:, :end] if self.padded else None
        logits = self.model(ids, cache=self.cache, attention_mask=mask, last_only=True)
        return logits[:, -1, : self.vocab].float()  # (B, V): only the last position went through the head

    def _make_room(self) -> None:
        # The cache spans the window but shorter rows still have room: drop the leading positions that are
        # padding in every unfinished row (they carry nothing), shifting the cache and mask left.
        length = self.cache.length
        pads = [length - self.lengths[i] + 1 for i, r in enumerate(self.rows) if r.finish_reason is None]
        drop = min(pads)  # >= 1: an unfinished row holds fewer than n_positions tokens
        self.cache.drop_front(drop)
        self.mask[:, : length - drop] = self.mask[:, drop:length].clone()
        self.mask[:, length - drop :] = False

    def _feed(self, tokens: torch.Tensor) -> None:
        if self.cache.length == self.cache.max_len:
            self._make_room()
        self.mask[:, self.cache.length] = True
        self._logits = self._forward(tokens[:, None])

    @torch.inference_mode()
    def step(self) -> list[int | None]:
        """Choose the next token of every unfinished row and return them (None for finished rows).

        Raises:
            GenerationError: if an unfinished row's logits hold NaN or infinity.
        """
        if self._pending is not None:
            self._feed(self._pending)
            self._pending = None
        active = [i for i, row in enumerate(self.rows) if row.finish_reason is None]
        if not active:
            return [None] * len(self.rows)
        logits = self._logits if len(active) == len(self.rows) else self._logits[active]
        if not torch.isfinite(logits).all():
            raise GenerationError(
                "the model produced NaN or infinite logits; the checkpoint may be corrupt, or float16 "
                "overflowed (try dtype='float32' or 'bfloat16')"
            )
        if self.sampling.penalized:
            logits_for_choice = apply_penalties(logits, self.seen[active], self.counts[active], self.sampling)
        else:
            logits_for_choice = logits
        chosen = choose(logits_for_choice, self.sampling, [self.generators[i] for i in active])
        if self.rows[0].logprobs is not None:
            picked = torch.log_softmax(logits, dim=-1).gather(-1, chosen[:, None])[:, 0].tolist()
        out: list[int | None] = [None] * len(self.rows)
        for j, (i, token) in enumerate(zip(active, chosen.tolist(), strict=True)):
            self._record(i, token, picked[j] if self.rows[i].logprobs is not None else None)
            out[i] = token
        if not self.done:
            pending = torch.zeros(len(self.rows), dtype=torch.long, device=self._logits.device)
            pending[active] = chosen
            self._pending = pending
        return out

    def _record(self, i: int, token: int, logprob: float | None) -> None:
        row = self.rows[i]
        row.token_ids.append(token)
        if logprob is not None:
            row.logprobs.append(logprob)
        if self.sampling.penalized:
            self.seen[i, token] = True
            self.counts[i, token] += 1
        self.lengths[i] += 1
        if token == self.eos_id:
            row.finish_reason = "stop"
        elif len(row.token_ids) >= self.max_new_tokens or self.lengths[i] >= self.model.config.n_positions:
            row.finish_reason = "length"


def check_prompt(prompt: Sequence[int], vocab: int, window: int) -> None:
    """Check one token id prompt against the model's vocabulary and window.

    Raises:
        ValueError: for an empty prompt, an id outside ``0..vocab-1``, or one that leaves no room to generate.
    """
    if len(prompt) == 0:
        raise ValueError("the prompt has no tokens; start it with <|endoftext|> (id 50256) for none")
    if len(prompt) >= window:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens but the model's window is {window} positions, which leaves "
            f"room for at most {window - 1} prompt tokens; shorten the prompt"
        )
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"the prompt has token id {bad[0]} outside the vocabulary 0..{vocab - 1}")


def check_prompts(prompts: Sequence[Sequence[int]], vocab: int, window: int) -> None:
    """:func:`check_prompt` for each prompt; the message says which (``prompt i``, counted from 0)."""
    if not prompts:
        raise ValueError("no prompts given; pass at least one")
    for i, p in enumerate(prompts):
        try:
            check_prompt(p, vocab, window)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None


def _check_request(prompts: Sequence[Sequence[int]], max_new_tokens: int, vocab: int, window: int) -> None:
    if (
        not isinstance(max_new_tokens, numbers.Integral)
        or isinstance(max_new_tokens, bool)
        or max_new_tokens < 0
    ):
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_prompts(prompts, vocab, window)


def generate_ids(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 64,
    sampling: SamplingParams | None = None,
    seed: int | Sequence[int | None] | None = None,
    eos_id: int | None = 50256,
    logprobs: bool = False,
) -> list[TokenCompletion]:
    """Generate from token id prompts; the token-level API.

    Args:
        model: the model (eval mode).
        prompts: non-empty token id lists of any lengths (run as one left-padded batch).
        max_new_tokens: the most tokens per row.
        sampling: how tokens are chosen (default: ``SamplingParams()``, temperature 1).
        seed: one seed for every row (each row draws from its own generator seeded with it, so a row's
            output does not depend on the rest of the batch), a sequence of per-row seeds, or None.
        eos_id: the end-of-text id that stops a row (None: never).
        logprobs: also return each chosen token's log-probability.

    Returns:
        One :class:`TokenCompletion` per prompt, in order.

    Example:
        >>> generate_ids(model, [[464, 3290]], max_new_tokens=5, sampling=SamplingParams(temperature=0))
        ... # doctest: +SKIP
    """
    seeds = list(seed) if isinstance(seed, Sequence) else [seed] * len(prompts)
    decoder = Decoder(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling or SamplingParams(),
                      seeds=seeds, eos_id=eos_id, logprobs=logprobs)  # fmt: skip
    while not decoder.done:
        decoder.step()
    return decoder.rows
