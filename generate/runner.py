"""The runner: turns the engine's slots into model calls, eager or compiled.

Prefill is eager (prompts have many lengths). Prompts that join in the same step are packed into one pass
(:meth:`GPT.packed_prefill`): the projections and MLPs read the weights once for all of them, and each
prompt's attention runs alone, with the shapes it has alone. A pass's positions are padded to one of a few
row counts (:data:`PACK_ROWS`; a longer prompt runs alone, unpadded) and the output head's rows to one of
:data:`PACK_HEAD_ROWS`. Packing is used only where a check at start
(:func:`generate.probes.rows_independent`) finds that at every one of these counts a row's bits do not
depend on the other rows: a prompt's logits and cache are then the same in any pass as alone, a single
prompt included (it is a pass of one). Elsewhere each prompt is prefilled alone.

The decode step runs every slot at once, each row at its own position, and reads only the span of cache
positions that holds every row's position: the next of :func:`next_span`'s lengths (64, 96, 128, 192,
...; the cache's own length last), so a short request in an engine made for the whole window reads 64
positions a step, not 1,024. A row's attention must then give the same bits over any of these spans, or
its tokens would depend on how far the other rows have got; a check at start confirms that on the machine
(eager: :func:`generate.probes.spans_agree` on the model's attention; compiled:
:func:`generate.probes.step_spans_agree` on the whole step), and where it does not hold the step reads
every position. Compiled on the CPU, the span is the step's one dynamic size (its other shapes are static,
one graph); the CUDA step reads every position.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence

import torch

from generate.kernels import DECODE_PIECE_SIZES, OneDNNLinear, UpcastBF16, decode_copy
from generate.probes import (
    body_blocks_fit,
    head_blocks_pays,
    onednn_pays,
    rows_independent,
    spans_agree,
    step_spans_agree,
    upcast_blocks_fit,
    upcast_min_rows,
    upcast_pieces_fastest,
)
from generate.routes import model_facts, recorded
from model import GPT, KVCache

# Packed prefill: a pass's positions are padded to the next of these row counts (the last is the most a
# pass holds; a longer prompt runs alone), and the head's rows to the next of PACK_HEAD_ROWS (the last is the
# most prompts in a pass). Few counts, so the check at start covers every one a pass can have.
PACK_ROWS = (16, 32, 48, 64, 96, 128, 192, 256)
PACK_HEAD_ROWS = (2, 4, 8, 16)

# The eager decode step's routes (onednn, head_blocks, body_blocks, upcast_blocks, and the upcast pieces' size
# where upcast_blocks is set), as Runner keys its copies.
RouteKey = tuple[bool, int | None, int | None, int | None, int | None]

# rows_independent's answers in this process, by what decides the kernels' summation order.
_independent: dict[tuple, bool] = {}


def next_span(positions: int) -> int:
    """The span that holds ``positions``: the next of 64, 96, 128, 192, 256, 384, 512, 768, 1024, ...
    (powers of two and the points halfway between). A decode step reads every slot's keys and values over
    its span, so a span less than half again as long as needed (a power of two alone could be nearly twice
    as long) reads less each step; compiled, it costs one more compile per doubling."""
    span = 64
    while span < positions:
        span = span * 3 // 2 if span & (span - 1) == 0 else span * 4 // 3
    return span


def decode_spans(max_len: int) -> tuple[int, ...]:
    """The spans a decode step over a cache of ``max_len`` positions may read: every
    :func:`next_span` length below ``max_len``, then ``max_len``."""
    spans, span = [], next_span(1)
    while span < max_len:
        spans.append(span)
        span = next_span(span + 1)
    return (*spans, max_len)


def _count_or_none(value: object) -> bool:
    """Whether a kept route answer is one its measurement could give: a positive int, or None."""
    return value is None or (type(value) is int and value > 0)


def _next(count: int, counts: tuple[int, ...]) -> int:
    """The smallest of ``counts`` (ascending) that holds ``count``, or ``count`` itself past the last."""
    return next((c for c in counts if c >= count), count)


class Runner:
    """Calls the model for the engine.

    Args:
        model: the model (eval mode).
        cache: the engine's KV cache.
        compile: compile the decode step (see :func:`generate.compiled.compile_step`).

    Attributes:
        spans: the spans the decode step reads (see the module docstring): :func:`decode_spans` of the
            cache's length where the check holds (eager: :func:`generate.probes.spans_agree`; compiled,
            where the step takes a span: :func:`generate.probes.step_spans_agree`), else the cache's
            length alone.
        onednn: whether the eager decode step runs its fp32 products in oneDNN
            (:func:`generate.kernels.decode_copy`): where the products alone are faster there
            (:func:`generate.probes.onednn_pays`), whole steps are timed both ways when the runner is made.
        head_blocks: the eager decode step's fp32 head runs in this many row blocks
            (:func:`generate.kernels.blocked_product`), or None: where the head alone is faster so
            (:func:`generate.probes.head_blocks_pays`), whole steps are timed both ways, as for
            :attr:`onednn` (decided after it).
        body_blocks: the eager decode step's fp32 linear layers run in this many row blocks, one per
            thread (:func:`generate.kernels.blocked_linear`), or None: where they can
            (:func:`generate.probes.body_blocks_fit`) and whole steps are at least 3% faster so (decided
            after :attr:`head_blocks`).
        onednn_prefill: the same for prefill's fp32 products, measured at 32 rows.
        upcast_rows: bf16 products of at least this many rows (linear layers, and a prompt's attention
            products from this many queries) run in fp32 in eager prefills, or None; measured on CPUs
            without native bf16 (:func:`generate.probes.upcast_min_rows`).
        upcast_blocks: the eager decode step's bf16 products run in fp32 on upcast pieces of the weight in
            this many row blocks, one per thread (:func:`generate.kernels.decode_copy`), or None: on CPUs
            without native bf16, where that gives every row the same bits in every place
            (:func:`generate.probes.upcast_blocks_fit`) and whole steps are at least 3% faster so, in
            pieces of :attr:`upcast_pieces`.
        upcast_pieces: the fp32 bytes of the upcast route's pieces, of
            :data:`generate.kernels.DECODE_PIECE_SIZES` the smallest within 5% of the fastest for the step's
            products (:func:`generate.probes.upcast_pieces_fastest`), or None where the route has no products.
    """

    def __init__(self, model: GPT, cache: KVCache, *, compile: bool = False) -> None:
        self.model, self.cache = model, cache
        self._decode: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None
        self.spans: tuple[int, ...] = (cache.max_len,)
        self.onednn = False
        self.head_blocks: int | None = None
        self.body_blocks: int | None = None
        self.upcast_blocks: int | None = None
        self.upcast_pieces: int | None = None
        self._routed: dict[RouteKey, GPT] = {}  # _decode_model's copies, by route
        facts = model_facts(model)
        if compile:  # first: a compile refused for want of memory leaves nothing behind, not even routes.json
            from generate.compiled import compile_step

            self._decode, spans, key = compile_step(model, cache)
            if len(spans) > 1 and recorded(
                "compiled-spans",  # (per library: the kernels autotuning chose are its own)
                {**facts, "slots": cache.slots, "spans": spans, "step": key},
                lambda: step_spans_agree(self._decode, cache, spans, model.config.vocab_size),
            ):
                self.spans = spans
        self.upcast_rows = recorded(
            "upcast-rows",
            facts,
            lambda: upcast_min_rows(model),
            _count_or_none,
        )
        self.onednn_prefill = self.upcast_rows is None and recorded(
            "onednn-prefill", {**facts, "rows": PACK_ROWS[1]}, lambda: onednn_pays(model, PACK_ROWS[1])
        )
        if not compile:
            spans = decode_spans(cache.max_len)
            if len(spans) > 1 and recorded(
                "decode-spans",
                {**facts, "slots": cache.slots, "spans": spans},
                lambda: spans_agree(model, cache.slots, spans),
            ):
                self.spans = spans
            shape = {**facts, "slots": cache.slots, "max_len": cache.max_len}
            self.onednn = recorded(
                "onednn-decode",
                shape,
                lambda: onednn_pays(model, cache.slots) and self._steps_faster_with("onednn"),
            )
            self.head_blocks = recorded(
                "head-blocks",
                {**shape, "onednn": self.onednn},
                self._measure_head_blocks,
                _count_or_none,
            )
            blocks = torch.get_num_threads()
            self.body_blocks = recorded(
                "body-blocks",
                {**shape, "onednn": self.onednn, "head_blocks": self.head_blocks, "blocks": blocks},
                lambda: self._blocks_if_faster("body_blocks", body_blocks_fit, blocks),
                _count_or_none,
            )
            self.upcast_pieces = recorded(
                "upcast-pieces",
                {**shape, "blocks": blocks, "sizes": DECODE_PIECE_SIZES},
                lambda: upcast_pieces_fastest(model, cache.slots, blocks),
                lambda value: value is None or value in DECODE_PIECE_SIZES,
            )
            pieces = self.upcast_pieces
            self.upcast_blocks = (
                None
                if pieces is None
                else recorded(
                    "upcast-blocks",
                    {**shape, "blocks": blocks, "pieces": pieces},
                    lambda: self._blocks_if_faster(
                        "upcast_blocks", lambda *a: upcast_blocks_fit(*a, piece_bytes=pieces), blocks
                    ),
                    _count_or_none,
                )
            )

    def _measure_head_blocks(self) -> int | None:
        """:attr:`head_blocks`: the row blocks :func:`generate.probes.head_blocks_pays` finds fastest for
        the head (at least 5% faster than the head's other product), if whole steps are no slower with them.
        Whole steps are not held to a 3% gain here: the head is only part of a step, and its gain is within
        their noise (GPT-2 124M at batch 1, AVX2 emulated on a Zen 4: steps 4-5% faster in blocks, but a
        3% test of best-of-3 timings said so in 3 of 5 tries)."""
        blocks = head_blocks_pays(self.model, self.cache.slots, self.onednn)
        faster = blocks is not None and self._steps_faster_with("head_blocks", blocks, None, by=1.0)
        return blocks if faster else None

    def _blocks_if_faster(self, route: str, fit: Callable[[GPT, int, int], bool], blocks: int) -> int | None:
        """:attr:`body_blocks` or :attr:`upcast_blocks` (``route``): ``blocks`` where ``fit`` says the step's
        products can run in them (:func:`generate.probes.body_blocks_fit`, fp32;
        :func:`generate.probes.upcast_blocks_fit`, emulated bf16) and whole steps are at least 3% faster
        so. (The upcast route, GPT-2 124M at 8 rows, AVX2 and bf16 emulated on a 2-core Zen 4 VM, taking turns
        in one process: 3 MiB pieces 50-60 ms a step against 60-70 in bf16 while its vCPUs did not share an
        L3, 42-46 against 61-84 while they did; at 1 row the products alone took twice as long as in bf16.)"""
        fits = fit(self.model, self.cache.slots, blocks)
        return blocks if fits and self._steps_faster_with(route, blocks, None) else None

    def _steps_faster_with(
        self, route: str, on: object = True, off: object = False, by: float = 0.97
    ) -> bool:
        """Time whole eager decode steps with the attribute ``route`` set to ``off`` and to ``on`` (best of 3
        each, alternated); leave it ``off`` unless ``on`` took less than ``by`` times as long (by default,
        at least 3% faster). A step's cost beyond its products does not show in a product's own timing: for
        :attr:`onednn`, the copy's Python ``forward`` methods (a mode, as this route once was, cost about
        2.7 ms a step on the shipped 19M model); for an upcast route, the rest of the step, which the
        upcast pieces evict from cache (GPT-2 124M at 8 rows, AVX2 and bf16 emulated on a Zen 4: 70.7 ms a
        step with the pieces' products in ``F.linear`` against 59.8 plain, while the MLP products alone
        measured faster upcast). A model copy made for a losing route is dropped."""
        tokens = torch.zeros(self.cache.slots, dtype=torch.long)
        best = [float("inf"), float("inf")]
        for _ in range(3):
            for i, value in enumerate((off, on)):
                setattr(self, route, value)
                self._decode_model()  # (a copy is made on the first step of a route: not timed)
                start = time.perf_counter()
                self.decode(tokens, tokens)  # writes position 0 of every slot (cleared as a request joins)
                best[i] = min(best[i], time.perf_counter() - start)
        faster = best[1] < by * best[0]
        setattr(self, route, on if faster else off)
        key = self._route_key
        self._routed = {key: self._routed[key]} if key in self._routed else {}
        return faster

    def _eager_routes(
        self, rows: int | None = None, upcast: bool = True
    ) -> contextlib.AbstractContextManager:
        """The eager kernel routes of a prefill whose products have at most ``rows`` rows (None: any);
        ``upcast=False`` leaves bf16 products as they are. (A decode step's routes are a copy of the model's
        modules, :meth:`_decode_model`: no mode.) The bf16 upcast mode is entered only where a product can
        reach its row count: a mode costs microseconds on every torch call (on an emulated-bf16 CPU, a GPT-2
        124M batch-1 step took 1.2x as long inside a mode that never applied), and without it the same
        kernels run."""
        if self.upcast_rows is not None:
            applies = upcast and (rows is None or rows >= self.upcast_rows)
            return UpcastBF16(self.upcast_rows) if applies else contextlib.nullcontext()
        return OneDNNLinear() if self.onednn_prefill else contextlib.nullcontext()

    def _decode_model(self) -> GPT:
        """The model the eager decode step calls: with :attr:`onednn`, :attr:`head_blocks`,
        :attr:`body_blocks` or :attr:`upcast_blocks`, a copy of its modules sharing its tensors whose
        products take those routes (:func:`generate.kernels.decode_copy`), taken at its first use (modules
        swapped in the model after that are not seen by the eager step)."""
        key = self._route_key
        if key == (False, None, None, None, None):
            return self.model
        if key not in self._routed:
            onednn, head_blocks, body_blocks, upcast_blocks, upcast_pieces = key
            self._routed[key] = decode_copy(self.model, onednn=onednn, head_blocks=head_blocks,
                                            body_blocks=body_blocks, upcast_blocks=upcast_blocks,
                                            upcast_pieces=upcast_pieces)  # fmt: skip
        return self._routed[key]

    @property
    def _route_key(self) -> RouteKey:
        """The eager decode step's routes, as :attr:`_routed` keys its module copies."""
        pieces = None if self.upcast_blocks is None else self.upcast_pieces
        return self.onednn, self.head_blocks, self.body_blocks, self.upcast_blocks, pieces

    @property
    def packs(self) -> bool:
        """Whether prompts joining together are prefilled in one pass (see the module docstring); checked
        once per machine for each kind of model, dtype, device, thread count and route (kept as the routes
        are, :mod:`generate.routes`)."""
        facts = self._probe_facts()
        key = json.dumps([facts, torch.get_num_threads()], sort_keys=True)
        if key not in _independent:

            def check() -> bool:  # under the routes _packed takes: the head's without the upcast mode
                with self._eager_routes():
                    body = rows_independent(self.model, PACK_ROWS, ())
                with self._eager_routes(upcast=False):
                    return body and rows_independent(self.model, (), PACK_HEAD_ROWS)

            _independent[key] = recorded("packed-prefill", facts, check)
        return _independent[key]

    def _probe_facts(self) -> dict[str, object]:
        """What decides the kernels' summation order for prefill's calls."""
        return {**model_facts(self.model), "rows": PACK_ROWS, "head_rows": PACK_HEAD_ROWS,
                "upcast_rows": self.upcast_rows, "onednn": self.onednn_prefill}  # fmt: skip

    def prefill_many(self, prompts: Sequence[tuple[list[int], int]]) -> list[torch.Tensor]:
        """Prefill ``(prompt, slot)`` pairs, packed into passes where that keeps every row's bits (see the
        module docstring); returns each prompt's last-position logits, (V,), in order."""
        if not prompts or not self.packs:
            return [self.prefill(prompt, slot) for prompt, slot in prompts]
        out: list[torch.Tensor] = []
        group: list[tuple[list[int], int]] = []
        for prompt, slot in prompts:
            full = (
                len(group) == PACK_HEAD_ROWS[-1]
                or sum(len(p) for p, _ in group) + len(prompt) > PACK_ROWS[-1]
            )
            if group and full:
                out += self._packed(group)
                group = []
            group.append((prompt, slot))
        return out + self._packed(group)

    def _packed(self, prompts: list[tuple[list[int], int]]) -> list[torch.Tensor]:
        device, lengths = self.model.device, [len(p) for p, _ in prompts]
        total = sum(lengths)
        ids = torch.zeros(_next(total, PACK_ROWS), dtype=torch.long, device=device)
        ids[:total] = torch.tensor([t for p, _ in prompts for t in p], device=device)
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        segments = [(slot, n) for (_, slot), n in zip(prompts, lengths, strict=True)]
        with self._eager_routes(rows=len(ids)):
            hidden = self.model.packed_prefill(ids, self.cache, segments)
        rows = hidden.new_zeros(_next(len(prompts), PACK_HEAD_ROWS), hidden.shape[1])
        rows[: len(prompts)] = hidden[last]
        # The head's few rows (2-16) stay out of the bf16 upcast mode: where its row count fell among them,
        # a prompt's head would take the route in one pack and not in another (a row's bits would differ,
        # and packing was refused: GPT-2 124M, bf16 emulated on a Zen 4, 16 rows).
        with self._eager_routes(upcast=False):
            logits = self.model.wte.project(rows)
        return list(logits[: len(prompts)])

    def prefill(self, prompt: list[int], slot: int) -> torch.Tensor:
        """Write a prompt's keys and values into ``slot`` and return the last position's logits, (V,)."""
        device = self.model.device
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        positions = torch.arange(len(prompt), device=device)[None]
        with self._eager_routes(rows=len(prompt)):
            logits = self.model(ids, positions=positions, cache=self.cache, slot=slot, span=len(prompt),
                                last_only=True)  # fmt: skip
        return logits[0, -1]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for every slot at its own position: (slots,) ids and positions -> (slots, V) logits."""
        device = self.model.device
        with torch.inference_mode():  # fresh inference tensors every step, as the compiled step was traced on
            tokens, rows = tokens.to(device).clone()[:, None], positions.to(device).clone()[:, None]
            span = next(s for s in self.spans if s > int(positions.max()))  # (the last holds every position)
            if self._decode is not None:
                return self._decode(tokens, rows, span)
            model = self._decode_model()
            return model(tokens, positions=rows, cache=self.cache, span=span, last_only=True)[:, -1]
