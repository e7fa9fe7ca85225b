"""The Python API: ``generate.load(...)`` returns a :class:`Generator` that turns prompts into text."""

from __future__ import annotations

import os
from collections.abc import Generator as PyGenerator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import tiktoken
import torch

import checkpoints
from generate.engine import Decoder, check_prompts, check_seed
from generate.sampling import SamplingParams
from generate.text import TextTracker
from model import GPT

DEFAULT_CHECKPOINT = "shakespeare"


@dataclass
class Completion:
    """One generated continuation.

    Attributes:
        text: the generated text (prompt excluded; cut before a stop string; EOS not included).
        token_ids: every generated token id, the EOS id included when it ended the text, and the tokens
            that spelled a stop string.
        finish_reason: ``"stop"`` (EOS or a stop string) or ``"length"`` (``max_new_tokens`` or the end of
            the model's window).
        logprobs: with ``logprobs=True``, the log-probability of each token in ``token_ids`` under the
            model's own distribution (before temperature, filters and penalties); else None.
        prompt_tokens: how many tokens the prompt had.
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None = None
    prompt_tokens: int = 0


class Generator:
    """A loaded model and its tokenizer, ready to generate.

    Args:
        model: the model (put in eval mode here).
        tokenizer: the GPT-2 tiktoken encoding (default: the vendored one).
    """

    def __init__(self, model: GPT, tokenizer: tiktoken.Encoding | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer or checkpoints.load_tokenizer()

    def encode(self, prompt: str) -> list[int]:
        """Prompt text to token ids. ``"<|endoftext|>"`` in the text is plain text, not the special token;
        an empty prompt becomes ``[<|endoftext|>]``, so the model starts as at a document's beginning."""
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a str, got {type(prompt).__name__}")
        return self.tokenizer.encode_ordinary(prompt) or [checkpoints.EOT_ID]

    def _run(
        self, ids: Sequence[list[int]], options: dict, seed: int | Sequence[int | None] | None
    ) -> PyGenerator[tuple[int, str], None, list[Completion]]:
        """Run encoded prompts as one batch: yield (row, settled text) as it comes; return completions."""
        stop = options.pop("stop")
        stop = [stop] if isinstance(stop, str) else list(stop or ())
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        max_new_tokens = options.pop("max_new_tokens")
        logprobs = options.pop("logprobs")
        sampling = SamplingParams(**options)
        seeds = list(seed) if isinstance(seed, Sequence) else [seed] * len(ids)
        if len(seeds) != len(ids):
            raise ValueError(f"got {len(seeds)} seeds for {len(ids)} prompts; pass one per prompt")
        # Only ids the tokenizer can spell are chosen (a checkpoint may pad its vocabulary, e.g. to 50304).
        decoder = Decoder(self.model, ids, max_new_tokens=max_new_tokens, sampling=sampling, seeds=seeds,
                          eos_id=checkpoints.EOT_ID, logprobs=logprobs,
                          vocab_limit=self.tokenizer.n_vocab)  # fmt: skip
        texts = [TextTracker(self.tokenizer.decode_single_token_bytes, stop) for _ in ids]
        while not decoder.done:
            for row, token in enumerate(decoder.step()):
                if token is None:
                    continue
                if token != checkpoints.EOT_ID and texts[row].add(token):
                    decoder.finish(row, "stop")
                if decoder.rows[row].finish_reason is not None:
                    texts[row].close()
                piece = texts[row].take(final=decoder.rows[row].finish_reason is not None)
                if piece:
                    yield row, piece
        return [
            Completion(text=t.text, token_ids=r.token_ids, finish_reason=r.finish_reason or "length",
                       logprobs=r.logprobs, prompt_tokens=len(p))
            for t, r, p in zip(texts, decoder.rows, ids, strict=True)
        ]  # fmt: skip

    def generate(
        self,
        prompt: str | Sequence[str],
        *,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        stop: str | Sequence[str] | None = None,
        seed: int | Sequence[int | None] | None = None,
        logprobs: bool = False,
        batch_size: int = 16,
    ) -> Completion | list[Completion]:
        """Continue one prompt (returns a :class:`Completion`) or several (returns a list, in order).

        Several prompts run as left-padded batches of up to ``batch_size``; each row's output is what
        that prompt gives alone. Sampling options are those of :class:`generate.SamplingParams`.

        Args:
            prompt: the text to continue, or a list of texts (an empty list gives an empty list).
                ``""`` starts from ``<|endoftext|>``.
            max_new_tokens: the most tokens to generate (0 returns empty text).
            stop: a string or strings that end the text when generated; they are not returned.
            seed: a seed that makes sampling reproducible (the same for a prompt alone or in a batch),
                or one seed per prompt.
            logprobs: return each generated token's log-probability.
            batch_size: the most prompts run together.

        Raises:
            ValueError: for a parameter out of range or a prompt that does not fit the model's window.
            MemoryError: if a batch's KV cache would not fit in the memory available (checked up front).
            generate.GenerationError: if the model produces NaN or infinite logits.

        Example:
            >>> gen.generate("To be, or not to be", max_new_tokens=20, temperature=0).text  # doctest: +SKIP
        """
        options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                       frequency_penalty=frequency_penalty, stop=stop, logprobs=logprobs)  # fmt: skip
        if isinstance(prompt, str):
            return self._drain(self._run([self.encode(prompt)], options, seed))[0]
        ids = [self.encode(p) for p in prompt]
        if not ids:
            return []  # a batch of no prompts has no completions
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        seeds = list(seed) if isinstance(seed, Sequence) else [seed] * len(ids)
        if len(seeds) != len(ids):
            raise ValueError(f"got {len(seeds)} seeds for {len(ids)} prompts; pass one per prompt")
        for s in seeds:
            check_seed(s)
        # Every prompt is checked before the first batch runs, and an error names it by its index in `prompt`.
        check_prompts(ids, self.model.config.vocab_size, self.model.config.n_positions)
        out: list[Completion] = []
        for start in range(0, len(ids), batch_size):
            chunk = slice(start, start + batch_size)
            out.extend(self._drain(self._run(ids[chunk], dict(options), seeds[chunk])))
        return out

    @staticmethod
    def _drain(run: PyGenerator[tuple[int, str], None, list[Completion]]) -> list[Completion]:
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: str, **options: object) -> Iterator[str]:
        """Yield the continuation of ``prompt`` piece by piece as it is generated.

        Takes the keyword options of :meth:`generate`. Pieces never split a UTF-8 character or show part
        of a stop string, so ``"".join(gen.stream(p, ...)) == gen.generate(p, ...).text``.

        Example:
            >>> for piece in gen.stream("Once", max_new_tokens=50): print(piece, end="")  # doctest: +SKIP
        """
        completion = yield from self.stream_completion(prompt, **options)
        del completion

    def stream_completion(self, prompt: str, **options: object) -> PyGenerator[str, None, Completion]:
        """Like :meth:`stream`, and the generator's return value is the final :class:`Completion`."""
        seed = options.pop("seed", None)
        full = dict(max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                    presence_penalty=0.0, frequency_penalty=0.0, stop=None, logprobs=False)  # fmt: skip
        unknown = set(options) - set(full)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; see Generator.generate")
        full.update(options)
        run = self._run([self.encode(prompt)], full, seed)
        while True:
            try:
                _, piece = next(run)
            except StopIteration as done:
                return done.value[0]
            yield piece


def load(
    source: str | os.PathLike[str] = DEFAULT_CHECKPOINT,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> Generator:
    """Load a checkpoint (see :func:`checkpoints.load`) and the tokenizer into a :class:`Generator`.

    Args:
        source: a checkpoint directory or file, a shipped name (default ``"shakespeare"``) or a hub id.
        device: where to run (default CPU).
        dtype: ``float32`` (default), ``bfloat16``, ``float16``, ``"int8"`` (int8 weights, bf16 compute) or
            ``"int8-body"`` (the same with the output head in bf16).

    Example:
        >>> gen = load("shakespeare")  # doctest: +SKIP
        >>> gen.generate("To be, or not to be", max_new_tokens=40, seed=1).text  # doctest: +SKIP
    """
    return Generator(checkpoints.load(source, device=device, dtype=dtype))
