"""Checks and measurements that choose the eager kernel routes (:mod:`generate.kernels`) on the machine that
runs them: whether a route pays for a model here (timed on its own products, then by the runner on whole
steps), and whether it keeps a row's bits wherever the row stands among the rows, over any span, and in
any packed pass. The runner keeps each answer (:mod:`generate.routes`).

Random inputs throughout: a kernel's summation order depends on shapes, not values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from generate.kernels import (
    DECODE_PIECE_SIZES,
    Pieces,
    _bf16_cpu,
    _blocks_take,
    _divides,
    _onednn_linear,
    _upcast_linear,
    bf16_native,
    blocked_linear,
    blocked_product,
    onednn_available,
)
from model import GPT, KVCache
from model.embedding import TiedEmbedding


def body_blocks_fit(model: GPT, rows: int, blocks: int) -> bool:
    """Whether the decode step's linear layers can run in ``blocks`` row blocks (:func:`blocked_linear`) at
    ``rows`` rows: an fp32 CPU model with ``blocks`` > 1 whose block's ``nn.Linear`` layers take them, each
    giving a row the same bits in every position among the rows (:func:`_same_in_every_position`). Whether
    it pays is left to whole steps: one product's timing reads its weight from cache, where a step reads
    it from memory."""
    layers = [m for m in model.h[0].modules() if type(m) is nn.Linear]
    if blocks < 2 or model.device.type != "cpu" or not layers:
        return False
    inputs = [torch.randn(rows, 1, m.in_features) for m in layers]
    if not all(_divides(x, m.weight, blocks) for x, m in zip(inputs, layers, strict=True)):
        return False
    with torch.inference_mode():
        return all(
            _same_in_every_position(blocked_linear, x, m.weight, m.bias, blocks)
            for x, m in zip(inputs, layers, strict=True)
        )


def head_blocks_pays(
    model: GPT, rows: int, onednn: bool, candidates: tuple[int, ...] = (2, 4, 8)
) -> int | None:
    """How many row blocks (of ``candidates``) make this model's fp32 head fastest at ``rows`` rows, if
    that is at least 5% faster than the head's product on the decode step's other route (oneDNN's inner
    product with ``onednn``, else ``F.linear``) and a row gets the same bits in every position among the
    rows (:func:`_same_in_every_position`); else None. Measured here on the head itself (best of 3 each;
    about 0.2 s for GPT-2 124M). None unless the head is an fp32 CPU :class:`TiedEmbedding`."""
    weight = getattr(model.wte, "weight", None)
    if type(model.wte) is not TiedEmbedding or not isinstance(weight, torch.Tensor):
        return None
    x = torch.randn(rows, 1, weight.shape[1])
    if model.device.type != "cpu" or not _blocks_take(x, weight, max(candidates)):
        return None
    other = _onednn_linear if onednn and onednn_available() else F.linear
    with torch.inference_mode():
        times = {blocks: _best_of(blocked_product, x, weight, blocks) for blocks in candidates}
        baseline = _best_of(other, x, weight)
        best = min(times, key=times.__getitem__)
        if times[best] < 0.95 * baseline and _same_in_every_position(blocked_product, x, weight, best):
            return best
    return None


def _same_in_every_position(product: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any) -> bool:
    """Whether ``product(rows, *args)`` gives the first of ``x``'s rows the same bits placed at each
    position among other random rows (a kernel may sum a row in another order at another place: MKL did,
    for a product of one weight row). Random values: the order depends on shapes, not values."""
    want = product(x, *args)[0]
    generator = torch.Generator(device=x.device).manual_seed(0)
    for i in range(1, len(x)):
        others = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        others[i] = x[0]
        if not torch.equal(product(others, *args)[i], want):
            return False
    return True


def bf16_emulated(model: GPT) -> bool:
    """Whether ``model`` is a bf16 model on a CPU without native bf16 whose linear layers hold bf16 weights
    (quantized layers have their own kernels): the models prefill's upcast mode is for (the decode step's
    upcast route takes every bf16 product it finds: :func:`upcast_products`)."""
    if model.device.type != "cpu" or model.compute_dtype != torch.bfloat16 or bf16_native():
        return False
    layers = [m for m in model.h[0].modules() if isinstance(m, nn.Linear)]
    return bool(layers) and all(m.weight.dtype == torch.bfloat16 for m in layers)


def upcast_products(
    model: GPT, within: nn.Module | None = None
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The (weight, bias) of the bf16 products the decode step's upcast route takes
    (:func:`generate.kernels.decode_copy`'s ``upcast_blocks``) in ``model`` (or in its module ``within``):
    its dense linear layers and tied head whose weights are bf16 matrices (a dense bf16 model's every product,
    an int8-body or int4-body model's head). Empty unless bf16 is emulated on this CPU and the model computes
    in bf16 there."""
    if model.device.type != "cpu" or model.compute_dtype != torch.bfloat16 or bf16_native():
        return []
    modules = (model if within is None else within).modules()
    return [
        (m.weight, m.bias if type(m) is nn.Linear else None)
        for m in modules
        if type(m) in (nn.Linear, TiedEmbedding) and m.weight.dim() == 2 and _bf16_cpu(m.weight)
    ]


def upcast_blocks_fit(model: GPT, rows: int, blocks: int, piece_bytes: int) -> bool:
    """Whether the decode step's bf16 products (:func:`upcast_products`) can run in fp32 on upcast pieces of
    ``piece_bytes`` in ``blocks`` row blocks (:func:`generate.kernels.decode_copy`'s ``upcast_blocks``) at
    ``rows`` rows: there are such products, ``blocks`` > 1, and each of a block's and the head's gives a row
    the same bits in every position among the rows (:func:`_same_in_every_position`, in the route's pieces).
    Whether it pays is left to whole steps."""
    products = [*upcast_products(model, model.h[0]), *upcast_products(model, model.wte)]
    if blocks < 2 or not products:
        return False
    pieces = Pieces(piece_bytes)  # (the route's pieces: their rows are the products' shapes)
    with torch.inference_mode():
        return all(
            _same_in_every_position(
                _upcast_linear, torch.randn(rows, 1, w.shape[1]).bfloat16(), w, b, blocks, pieces
            )
            for w, b in products
        )


def upcast_pieces_fastest(
    model: GPT,
    rows: int,
    blocks: int,
    sizes: tuple[int, ...] = DECODE_PIECE_SIZES,
    trials: int = 3,
    within: float = 1.05,
) -> int | None:
    """Which of ``sizes`` (fp32 bytes) of upcast pieces makes the decode step's upcast route fastest for this
    model at ``rows`` rows in ``blocks`` row blocks, or None where the route is not for it (``blocks`` < 2,
    or no :func:`upcast_products`). Timed on every product the route takes in a step, one pass a trial (the
    weights come from memory, as in a step), the sizes taking turns; the best of ``trials`` each (GPT-2 124M
    at 8 rows: about 40 ms a pass). The best size depends on the caches and the shapes
    (``DECODE_PIECE_SIZES``), and on a VM on its state, which one measurement sees one of: of the sizes
    within ``within`` times the fastest's time, the smallest (a smaller piece leaves more of the caches to
    the rest of the step and to the other cores: on a 2-vCPU Zen 4 VM, GPT-2 124M at 8 rows, 8 MiB pieces
    were as fast as 3 MiB ones while the vCPUs shared an L3 and 40% slower while they did not)."""
    layers = upcast_products(model)
    if blocks < 2 or not layers:
        return None
    inputs = {w.shape[1]: torch.randn(rows, 1, w.shape[1]).bfloat16() for w, _ in layers}
    best, pieces = dict.fromkeys(sizes, math.inf), {size: Pieces(size) for size in sizes}
    with torch.inference_mode():
        for trial in range(trials + 1):  # (the first pass of each size is not counted)
            for size in sizes:
                start = time.perf_counter()
                for w, b in layers:
                    _upcast_linear(inputs[w.shape[1]], w, b, blocks, pieces[size])
                if trial:
                    best[size] = min(best[size], time.perf_counter() - start)
    return min(size for size in sizes if best[size] <= within * min(best.values()))


def upcast_min_rows(
    model: GPT, candidates: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), trials: int = 3
) -> int | None:
    """From how many rows bf16 products of this model run faster upcast to fp32, or None (never, or not a
    bf16 CPU model, or a CPU with native bf16: not measured there). Measured on one block's MLP products at
    ``candidates`` rows (:func:`_upcast_rows_once`), ``trials`` times; the median answer, None counting as
    the largest. One measurement near a break-even can come out either way, and the answer is kept (GPT-2
    124M with AVX2 and bf16 emulated on a Zen 4: single measurements gave 8, 16 and once None, which left a
    512-token prompt's prefill 4.4 s instead of 2.7)."""
    if not bf16_emulated(model):
        return None
    mlp = model.h[0].mlp
    layers = [(m.weight, m.bias) for m in (mlp.c_fc, mlp.c_proj)]
    answers = [_upcast_rows_once(layers, candidates) for _ in range(trials)]
    return sorted(answers, key=lambda rows: math.inf if rows is None else rows)[trials // 2]


def _upcast_rows_once(
    layers: list[tuple[torch.Tensor, torch.Tensor | None]], candidates: tuple[int, ...]
) -> int | None:
    """One measurement for :func:`upcast_min_rows`: the smallest of ``candidates`` from which the upcast
    product of ``layers`` (weight, bias) won (by 5%) at every larger one, or None."""
    wins = []
    with torch.inference_mode():
        for rows in candidates:
            plain = upcast = 0.0
            for w, b in layers:
                x = torch.randn(rows, w.shape[1], dtype=torch.bfloat16)
                plain += _best_of(F.linear, x, w, b, repeat=2)
                upcast += _best_of(_upcast_linear, x, w, b, repeat=2)
            wins.append(upcast < 0.95 * plain)
    for i, rows in enumerate(candidates):
        if all(wins[i:]):
            return rows
    return None


def _best_of(fn: Any, *args: Any, repeat: int = 3) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def onednn_pays(model: GPT, rows: int) -> bool:
    """Whether fp32 products of ``rows`` rows run faster in oneDNN than in ``F.linear`` for this model,
    measured here on its output head and one block's products (a few products of each; under 0.2 s for
    GPT-2 124M). False unless the model is fp32 on the CPU and oneDNN works."""
    if model.device.type != "cpu" or model.compute_dtype != torch.float32 or not onednn_available():
        return False
    block = model.h[0]
    products = (block.attn.c_attn, block.mlp.c_fc, block.mlp.c_proj)
    layers = [
        (getattr(model.wte, "weight", None), None),
        *((getattr(m, "weight", None), m.bias) for m in products),
    ]
    if any(not isinstance(w, torch.Tensor) or w.dtype != torch.float32 for w, _ in layers):
        return False  # quantized layers hold no fp32 weight
    with torch.inference_mode():
        aten = onednn = 0.0
        for w, b in layers:
            x = torch.randn(rows, 1, w.shape[1])
            aten += _best_of(F.linear, x, w, b)
            onednn += _best_of(_onednn_linear, x, w, b)
    return onednn < 0.95 * aten


def rows_independent(model: GPT, row_counts: tuple[int, ...], head_counts: tuple[int, ...]) -> bool:
    """Whether the model's per-position layers give a row the same bits whatever else is in the call.

    Checked on one block's layers (``ln_1``, the attention's two projections and the whole MLP; every block
    has the same kinds and shapes) at each of ``row_counts`` rows, and on the output head at each of
    ``head_counts``: the rows of each call, taken at two places, against the same rows inside a call of the
    largest count. Random inputs: a kernel's summation order depends on shapes, not values. Run it under
    the kernel routes the calls will use; a layer given no counts is not checked.
    """
    block, cfg = model.h[0], model.config
    layers = [(block.ln_1, cfg.n_embd, row_counts), (block.attn.c_attn, cfg.n_embd, row_counts),
              (block.attn.c_proj, cfg.n_embd, row_counts), (block.mlp, cfg.n_embd, row_counts),
              (model.wte.project, cfg.n_embd, head_counts)]  # fmt: skip
    options = {"dtype": model.compute_dtype, "device": model.device}
    generator = torch.Generator(device=model.device).manual_seed(0)
    with torch.inference_mode():
        for layer, width, counts in layers:
            if not counts:
                continue
            most = max(counts)
            x = torch.randn(most, width, generator=generator, **options)
            whole = layer(x)
            for rows in counts:
                for start in {0, (most - rows) // 2}:
                    if not torch.equal(layer(x[start : start + rows]), whole[start : start + rows]):
                        return False
    return True


def _positions_needing(
    spans: tuple[int, ...], rows: int, generator: torch.Generator, device: torch.device
) -> Iterator[tuple[int, torch.Tensor]]:
    """For each of ``spans`` but the last, twice: its index and (rows, 1) positions that need it (the first
    row at the span's last position, then at its first past the span before; the other rows anywhere in
    it). Both span checks compare their outputs over that span and every longer one at these."""
    for i, span in enumerate(spans[:-1]):
        for first in (span - 1, spans[i - 1] if i else 0):
            positions = torch.randint(0, span, (rows, 1), generator=generator, device=device)
            positions[0] = first
            yield i, positions


def spans_agree(model: GPT, rows: int, spans: tuple[int, ...]) -> bool:
    """Whether the model's cached attention gives a decode step's row the same bits over any of ``spans``
    (ascending) cache positions that hold the row's position.

    Checked on one layer's attention (every layer has the same kind and shapes) at one new token for each
    of ``rows`` rows, at :func:`_positions_needing` each span: the output over that span against the
    output over every longer one. Random inputs: a kernel's summation order depends on shapes, not values.
    Measured on a 2-core AMD EPYC Zen 4: spans of :func:`generate.runner.next_span` (64, 96, 128, ...)
    agreed with each other in fp32, bf16 and fp16 (2,618 comparisons, 1 and 2 threads), while spans that
    are not multiples of 16 sometimes did not (fp32, up to 1e-7 apart).
    """
    attn, cfg = model.h[0].attn, model.config
    generator = torch.Generator(device=model.device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=model.device).to(model.compute_dtype)

    made = (cfg, rows, spans[-1], model.compute_dtype, model.device)  # one layer's, in the cache's layout
    kv = (KVCache.buffer(*made), KVCache.buffer(*made))
    for buffer in kv:
        buffer.copy_(randn(*buffer.shape))
    with torch.inference_mode():
        for i, positions in _positions_needing(spans, rows, generator, model.device):
            q, k, v = (randn(rows, cfg.n_head, 1, cfg.head_dim) for _ in range(3))
            outputs = [attn._cached(q, k, v, positions, kv, longer) for longer in spans[i:]]
            if not all(torch.equal(out, outputs[0]) for out in outputs[1:]):
                return False
    return True


def step_spans_agree(
    step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    cache: KVCache,
    spans: tuple[int, ...],
    vocab_size: int,
) -> bool:
    """Whether a compiled decode ``step`` over ``cache`` gives every row the same logits over any of
    ``spans`` (ascending) cache positions that hold its position: :func:`spans_agree` for the whole step,
    whose kernels the compiler made. At :func:`_positions_needing` each span, with random tokens, the
    logits over that span against those over every longer one. It writes the cache at those positions (the
    engine clears a slot as a request joins).
    """
    device = cache.k[0].device
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        for i, positions in _positions_needing(spans, cache.slots, generator, device):
            tokens = torch.randint(0, vocab_size, (cache.slots, 1), generator=generator, device=device)
            logits = [step(tokens.clone(), positions.clone(), longer).clone() for longer in spans[i:]]
            if not all(torch.equal(out, logits[0]) for out in logits[1:]):
                return False
    return True
