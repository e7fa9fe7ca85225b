"""The Python API: ``generate.load(...)`` returns a :class:`Generator` that turns prompts into text."""

from __future__ import annotations

import contextlib
import numbers
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Generator as PyGenerator
from dataclasses import dataclass

import tiktoken
import torch

import checkpoints
from generate.engine.engine import NOT_FINITE_ADVICE, Engine, GenerationError, raise_errors
from generate.engine.memory import check_engine_memory, said_plainly
from generate.engine.request import Request, make_requests
from generate.engine.sampling import SamplingParams
from generate.engine.speculate import COMPILED_LOOKAHEAD, DEFAULT_LOOKAHEAD, Counts, make_speculator
from generate.score import DEFAULT_BATCH_SIZE as DEFAULT_SCORE_BATCH
from generate.score import Score, score_ids
from model import GPT, GPTConfig

DEFAULT_CHECKPOINT = "shakespeare"
DEFAULT_SLOTS = 8


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
        compile: run decode steps compiled (:mod:`generate.engine.compiled`): compiled once per
            checkpoint, dtype and engine width, then every call of any length runs on it.
        slots: how many prompts run at once (the engine's width); a longer list runs ``slots`` at a time,
            each prompt taking a slot as soon as one is free.
        deterministic: run every call in an engine of exactly ``slots`` rows, so that a prompt gives the
            same tokens and log-probabilities, bit for bit, alone or in a list of any length (a lone prompt
            then computes ``slots`` rows: 1.4-2.6x the time a token, GPT-2 124M on Zen 4). False (default):
            an engine only as wide as the call needs, a lone prompt in one row (compiled: one row, or
            ``slots`` for more prompts, two compiled steps); its logits may then differ in the last bits from
            the same prompt's in a list, and a near-tie can pick another token.
        progress: called with a line of text while a decode step compiles.
        draft: speculative decoding (:mod:`generate.engine.speculate`): ``"ngram"`` (prompt lookup) or a
            draft model sharing the tokenizer: with several rows the output is that of no proposals, bit
            for bit; a lone prompt gives the same tokens, logprobs within 1e-5 (compiled with AVX-512, its
            steps of up to 4 tokens are one library: the bits of no proposals). Compiled, a verifying step
            of another width is compiled too (once per width, as a decode step), and so is a draft model's
            one-token step.

    Calls may overlap (threads, streams read in turn): each gives what it gives alone. ``lock`` is held while
    one adds to, steps or reads the engine; code that steps :meth:`engine` itself holds it too.
    """

    def __init__(
        self,
        model: GPT,
        tokenizer: tiktoken.Encoding | None = None,
        *,
        compile: bool = False,
        slots: int = DEFAULT_SLOTS,
        deterministic: bool = False,
        progress: Callable[[str], None] | None = None,
        draft: GPT | str | None = None,
    ) -> None:
        if not (draft is None or draft == "ngram" or isinstance(draft, GPT)):
            raise ValueError(
                f"draft={draft!r}: give 'ngram' or a draft model (generate.load(..., draft=path))"
            )
        if isinstance(slots, bool) or not isinstance(slots, numbers.Integral) or slots < 1:
            raise ValueError(f"slots must be a positive integer, got {slots!r}")
        slots = int(slots)  # (a numpy integer too)
        self.model = model.eval()
        self.tokenizer = tokenizer or checkpoints.load_tokenizer()
        vocab = min(model.config.vocab_size, self.tokenizer.n_vocab)  # (the ids a prompt or output can hold)
        if isinstance(draft, GPT) and draft.config.vocab_size < vocab:
            raise ValueError(f"the draft's vocabulary has {draft.config.vocab_size} tokens, the model's "
                             f"{vocab}; give a draft sharing the model's tokenizer")  # fmt: skip
        self.compile, self.slots, self.deterministic = compile, slots, bool(deterministic)
        self.progress, self.draft = progress, draft
        self._counts = Counts()
        self._engine: Engine | None = None
        # Held while a call adds to, steps or reads the kept engine: calls may overlap (threads, streams).
        self.lock = threading.RLock()
        self._stepping, self._abandoned = False, []  # (see _step)

    @property
    def speculation(self) -> dict[str, float] | None:
        """Speculative decoding's counts over every call so far (proposals made and accepted, the acceptance
        rate, tokens per verifying pass of a row), or None without a draft."""
        return None if self.draft is None else self._counts.stats()

    def width(self, count: int) -> int:
        """The engine width a call of ``count`` prompts runs in: :attr:`slots` when deterministic; else as
        many as it needs, or compiled, 1 for one prompt and :attr:`slots` for more."""
        if self.deterministic:
            return self.slots
        if self.compile:
            return 1 if count == 1 else self.slots
        return max(1, min(self.slots, count))

    def encode(self, prompt: str) -> list[int]:
        """Prompt text to token ids. ``"<|endoftext|>"`` in the text is plain text, not the special token;
        an empty prompt becomes ``[<|endoftext|>]``, so the model starts as at a document's beginning."""
        if not isinstance(prompt, str):
            binary = isinstance(prompt, (bytes, bytearray))
            hint = "; decode it first (e.g. .decode('utf-8'))" if binary else ""
            raise TypeError(f"a prompt must be a str, got {type(prompt).__name__}{hint}")
        return self.tokenizer.encode_ordinary(prompt) or [checkpoints.EOT_ID]

    def score(
        self,
        text: str | Sequence[int],
        *,
        stride: int | None = None,
        batch_size: int = DEFAULT_SCORE_BATCH,
        progress: Callable[[int, int], None] | None = None,
    ) -> Score:
        """How well the model predicts ``text``: per-token log-probabilities, mean NLL, perplexity.

        Every token after the first is scored exactly once, with as much preceding context as the window
        allows: windows of ``n_positions`` tokens whose ends advance by ``stride`` (default half the
        window); see :mod:`generate.score`.

        Args:
            text: the text (encoded as ordinary text: ``"<|endoftext|>"`` in it is not the special token),
                or its token ids.
            stride: how far each window's end advances, in 1..n_positions-1.
            batch_size: windows computed together.
            progress: called with (tokens scored, tokens to score) after each batch of windows.

        Raises:
            ValueError: for a text of fewer than two tokens, or a stride or batch size out of range.
            TypeError: if ``text`` is neither a str nor a sequence of ints.
            GenerationError: if the logits hold NaN or infinity; MemoryError: out of memory (said plainly).

        Example:
            >>> gen.score("To be, or not to be, that is the question").perplexity  # doctest: +SKIP
        """
        text = text.tolist() if hasattr(text, "tolist") else text  # (a numpy array or tensor of ids)
        if isinstance(text, str):
            ids = self.tokenizer.encode_ordinary(text)
        elif (
            not isinstance(text, Sequence)
            or isinstance(text, (bytes, bytearray))
            or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in text)
        ):  # (an iterator is no sequence: checking it would use it up)
            name, hint = type(text).__name__, ""
            if isinstance(text, (bytes, bytearray)):
                hint = "; decode it first (e.g. .decode('utf-8'))"
            elif isinstance(text, Sequence):  # (an item no int: several texts, a 2-D array's rows, floats)
                bad = next(t for t in text if not isinstance(t, numbers.Integral) or isinstance(t, bool))
                name, hint = f"{name} holding {type(bad).__name__}", "; score one text a call, ids as ints"
            raise TypeError(f"text must be a str or a list of token ids (ints), got {name}{hint}")
        else:
            ids = [int(t) for t in text]
        return score_ids(self.model, ids, stride=stride, batch_size=batch_size, progress=progress)

    @torch.inference_mode()
    def attention(self, text: str, *, layer: int | None = None) -> torch.Tensor:
        """The softmax attention weights of every layer's causal attention over ``text``.

        Args:
            text: the text (:meth:`encode`: an empty text is the one ``<|endoftext|>`` token).
            layer: only this layer (from 0; negative counts from the last): a (n_head, T, T) tensor.

        Returns:
            A float32 tensor of shape (n_layer, n_head, T, T) on the CPU, T being the text's token count:
            entry ``[l, h, q, k]`` is how much position ``q`` attends to position ``k`` in head ``h`` of
            layer ``l``. Each row sums to 1 (in the model's dtype: bf16, int8 and int4 to 0.003, each weight
            rounded); the future (``k > q``) is exactly 0. These are the weights the forward uses, computed
            explicitly.

        Raises:
            ValueError: if the text has more tokens than the window (``n_positions``) or a token outside the
                model's vocabulary, or ``layer`` is out of range.
            MemoryError: if the allocator runs out of memory (said plainly).
            GenerationError: if the weights hold NaN or infinity (a corrupt checkpoint, fp16 overflow).
        """
        ids = self.encode(text)
        window, n_layer = self.model.config.n_positions, self.model.config.n_layer
        if len(ids) > window:
            raise ValueError(
                f"the text has {len(ids)} tokens but the window holds {window}; shorten it to at most "
                f"{window} tokens"
            )
        if (bad := max(ids)) >= (vocab := self.model.config.vocab_size):  # (a model below its tokenizer)
            raise ValueError(f"token id {bad} is outside the vocabulary 0..{vocab - 1}")
        integral = isinstance(layer, numbers.Integral) and not isinstance(layer, bool)
        if layer is not None and (not integral or not -n_layer <= layer < n_layer):
            raise ValueError(f"layer={layer!r} is out of range; this model has layers 0..{n_layer - 1}")
        x = torch.tensor([ids], device=self.model.device)
        with said_plainly("give a shorter text, one layer (layer=), or use a smaller dtype"):
            weights = self.model.attention_weights(x, None if layer is None else [layer % n_layer])[:, 0]
        check_attention(weights, self.model.compute_dtype)
        return weights.float().cpu() if layer is None else weights[0].float().cpu()

    def engine(self, slots: int, max_len: int) -> Engine:
        """An engine of ``slots`` slots holding ``max_len`` positions each, made once per shape and kept.

        The engine is kept and reused while it has ``slots`` slots and at least ``max_len`` positions (how
        many positions it holds changes no bits; its width does: see :attr:`slots`). One engine is kept at a
        time; a compiled engine holds the whole window, so one compile serves every call. While another call
        runs in the kept engine and it does not fit, or has no free slot (this call's requests would wait for
        the other's to end), this call gets an engine of its own, not kept (where memory allows: else it
        waits in the kept one).
        """
        max_len = min(max(max_len, 2), self.model.config.n_positions)
        kept = self._engine
        if kept is not None and kept.slots == slots and kept.cache.max_len >= max_len:
            if len(kept.running) + len(kept.waiting) < slots:
                return kept
            with contextlib.suppress(MemoryError):
                return self._make_engine(slots, max_len)
            return kept
        if kept is not None and kept.has_work:
            return self._make_engine(slots, max_len)
        self._engine = None  # (its KV cache, and on the CPU its compiled step, freed before the next is made)
        self._engine = self._make_engine(slots, max_len)
        return self._engine

    def _make_engine(self, slots: int, max_len: int) -> Engine:
        ahead = COMPILED_LOOKAHEAD if self.compile else DEFAULT_LOOKAHEAD
        speculate, model = None, self.model
        if self.draft is not None:  # (a draft's steps compile with the engine's: its memory is checked first)
            window = model.config.n_positions if self.compile else max_len  # (as Engine does)
            check_engine_memory(model.config, slots, window, model.compute_dtype, model.device)
            speculate = make_speculator(self.draft, slots, ahead, self._counts, compile=self.compile,
                                        progress=self.progress)  # fmt: skip
        return Engine(self.model, slots=slots, max_len=max_len, compile=self.compile, progress=self.progress,
                      token_bytes=self.tokenizer.decode_single_token_bytes,
                      vocab_limit=self.tokenizer.n_vocab, speculate=speculate)  # fmt: skip

    def _run(
        self, ids: Sequence[list[int]], options: dict, seed: int | Sequence[int | None] | None
    ) -> PyGenerator[tuple[int, str], None, list[Completion]]:
        """Run encoded prompts in an engine of :meth:`width` (a prompt joins as soon as a slot is free):
        yield (row, settled text) as it comes; return the completions.

        Calls may overlap (threads, streams read in turn): each steps the engine under the lock, which
        advances every call's requests, and takes only its own requests' text."""
        requests = self._requests(ids, options, seed)
        logprobs = options["logprobs"]
        longest = max(len(p) for p in ids) + max(1, requests[0].max_new_tokens)
        with self.lock:
            engine = self.engine(self.width(len(ids)), longest)
            for r in requests:
                engine.add(r)
        try:
            while True:
                with self.lock:  # (another call's step may be writing this text now)
                    finished = all(r.done for r in requests)
                    pieces = [(row, r.text.take(final=r.done)) for row, r in enumerate(requests)]
                for row, piece in pieces:
                    if piece:
                        yield row, piece
                raise_errors(requests)
                if finished:
                    break
                with self.lock:
                    if not all(r.done for r in requests):
                        self._step(engine)
        finally:
            with self.lock:  # an abandoned stream (or an error) leaves no request in the engine
                left = [(engine, r) for r in requests if not r.done]
                if self._stepping:  # (closed by the garbage collector inside a step: cancelled after it)
                    self._abandoned += left
                else:
                    for e, r in left:
                        e.cancel(r)
        return [
            Completion(text=r.text.text, token_ids=r.token_ids, finish_reason=r.finish_reason or "length",
                       logprobs=r.logprobs_list if logprobs else None, prompt_tokens=len(r.prompt))
            for r in requests
        ]  # fmt: skip

    def _requests(self, ids: Sequence[list[int]], options: dict, seed: object) -> list[Request]:
        """The requests for ``ids``, every option checked (ValueError naming it)."""
        sampling = {k: v for k, v in options.items() if k not in ("stop", "max_new_tokens", "logprobs")}
        cfg = self.model.config
        return make_requests(ids, seed, cfg.vocab_size, cfg.n_positions, sampling=SamplingParams(**sampling),
                             max_new_tokens=options["max_new_tokens"], eos_id=checkpoints.EOT_ID,
                             stop=options["stop"], logprobs=options["logprobs"])  # fmt: skip

    def _step(self, engine: Engine) -> None:
        """``engine.step()`` (under the lock), then cancel what streams closed during it left. An interrupt
        inside a step (Ctrl-C) may leave a slot half advanced: the engine's requests then end in an error,
        never in other text, and the engine is not kept."""
        self._stepping = True
        try:
            engine.step()
        except MemoryError:  # (raised before a step changes anything: the engine goes on)
            raise
        except BaseException:
            for r in [*engine.running.values(), *engine.waiting]:
                r.error = "a step was interrupted (Ctrl-C, or an error) in another call; generate it again"
                r.finish("error")
            self._engine = None if self._engine is engine else self._engine
            raise
        finally:
            self._stepping = False
            abandoned, self._abandoned = self._abandoned, []
            for e, r in abandoned:
                if not r.done:
                    e.cancel(r)

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
    ) -> Completion | list[Completion]:
        """Continue one prompt (returns a :class:`Completion`) or several (returns a list, in order).

        Several prompts run together in the generator's :attr:`slots`, a prompt taking a slot as soon as
        one is free; each prompt's output is what it gives alone (bit for bit where :attr:`deterministic`;
        docs/engine.md says what holds).
        Sampling options are those of :class:`generate.SamplingParams`.

        Args:
            prompt: the text to continue, or a list of texts (an empty list gives an empty list).
                ``""`` starts from ``<|endoftext|>``.
            max_new_tokens: the most tokens to generate (0 returns empty text).
            stop: a string or strings that end the text when generated; they are not returned.
            seed: a seed that makes sampling reproducible (the same for a prompt alone or in a batch),
                or one seed per prompt.
            logprobs: return each generated token's log-probability.

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
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
            self.encode(prompt)  # raises, naming the type (bytes would otherwise read as a list of ints)
        ids = [self.encode(p) for p in prompt]
        if not ids:  # a batch of no prompts has no completions; its options are checked all the same
            listed = isinstance(seed, Sequence) and not isinstance(seed, str)  # (seeds for no prompts)
            self._requests([[checkpoints.EOT_ID]], options, None if listed else seed)
            return []
        return self._drain(self._run(ids, options, seed))

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


def check_attention(weights: torch.Tensor, dtype: torch.dtype, where: str = "") -> None:
    """Raise :class:`GenerationError` if attention ``weights`` hold NaN or infinity (``where``: the layer)."""
    if not torch.isfinite(weights).all():
        raise GenerationError(f"the model produced NaN or infinite attention weights{where} (dtype {dtype}); "
                              f"{NOT_FINITE_ADVICE}")  # fmt: skip


def load(
    source: str | os.PathLike[str] = DEFAULT_CHECKPOINT,
    *,
    config: GPTConfig | str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    group_size: int | None = None,
    compile: bool = False,
    slots: int = DEFAULT_SLOTS,
    deterministic: bool = False,
    progress: Callable[[str], None] | None = None,
    draft: str | os.PathLike[str] | None = None,
) -> Generator:
    """Load a checkpoint (see :func:`checkpoints.load`) and the tokenizer into a :class:`Generator`.

    Args:
        source: a checkpoint directory or file, a shipped name (default ``"shakespeare"``) or a hub id.
        config: the model's config when ``source`` has none beside it (or to override it): a
            :class:`GPTConfig`, a preset name such as ``"gpt2"`` or a ``config.json`` path.
        device: where to run (default CPU).
        dtype: ``float32`` (default), ``bfloat16``, ``float16``, ``"int8"`` (int8 weights, bf16 compute),
            ``"int8-body"`` (the same with the output head in bf16), ``"int4"`` or ``"int4-body"`` (4-bit
            weights in groups).
        group_size: int4's group size: 32 (default), 64 or 128.
        compile: run decode steps compiled (see :class:`Generator`).
        slots: how many prompts run at once (see :class:`Generator`).
        deterministic: the same bits alone or in a list (see :class:`Generator`).
        progress: called with a line of text while a decode step compiles.
        draft: speculative decoding: ``"ngram"`` (prompt lookup) or a draft checkpoint sharing the
            tokenizer, loaded like ``source`` (same device and dtype); see :class:`Generator`.

    Example:
        >>> gen = load("shakespeare")  # doctest: +SKIP
        >>> gen.generate("To be, or not to be", max_new_tokens=40, seed=1).text  # doctest: +SKIP
    """
    # (compiled, the weights laid out plainly: a step of one row reads them in place)
    plain = compile and not deterministic
    if draft is not None and not isinstance(draft, (str, os.PathLike)):
        raise ValueError(f"draft={draft!r}: give 'ngram' or a draft checkpoint's path or name")
    model = checkpoints.load(
        source, config=config, device=device, dtype=dtype, group_size=group_size, plain=plain
    )
    if draft is not None and draft != "ngram":  # (a path, even one spelled ngram, is a checkpoint)
        try:
            draft = checkpoints.load(draft, device=device, dtype=dtype, group_size=group_size, plain=plain)
        except ValueError as e:  # (the options suit the target: say which model one does not fit)
            kind = checkpoints.CheckpointError if isinstance(e, checkpoints.CheckpointError) else ValueError
            name = f" {os.fspath(draft)}" if os.fspath(draft) else ""  # (an empty path: the error says so)
            raise kind(f"the draft{name}: {e}") from None
    return Generator(model, compile=compile, slots=slots, deterministic=deterministic, progress=progress,
                     draft=draft)  # fmt: skip
