"""Eager kernel routes, chosen on the machine that runs them; ``model/`` itself only calls ``F.linear``.

Prefill's routes (oneDNN for fp32 products, fp32 for bf16 products) are modes
(:class:`~torch.overrides.TorchFunctionMode`) the runner enters around eager calls. A mode costs
microseconds on every torch call, so the bf16 mode is entered only where a product reaches its row count,
and the eager decode step's routes (oneDNN, and row blocks for the head and the linear layers, in fp32; the
upcast route in bf16) are a copy of the model's modules, sharing its tensors, whose layers call their
kernels themselves (:func:`decode_copy`).

**oneDNN for fp32 decode.** fp32 products of the eager decode step on the CPU can run in oneDNN's inner
product (``torch.ops.mkldnn._linear_pointwise``, the kernel ``torch.compile`` uses for CPU linears) instead
of ``F.linear`` (MKL). On a 2-core AMD EPYC Zen 4, one row (batch 1), GPT-2 124M's products took: head
(50257 x 768) MKL 12.0 ms, oneDNN 6.1 ms; 3072 x 768 0.18 vs 0.09 ms; 768 x 768 about equal. Whether it pays
depends on the CPU and the row count, so :func:`onednn_pays` measures it for the model at hand when an
eager engine is made. Like MKL's, oneDNN's sums for a row depend on how many rows the product has, not on
the other rows' values, so rows stay bitwise independent within an engine either way.

**Row blocks for the fp32 head in decode.** A wide head read by a few rows runs faster as one batched
product over a few contiguous blocks of its rows (:func:`blocked_product`): GPT-2 124M's head at 1 row
4.8 ms against oneDNN's 5.8 on the Zen 4, and a batch-1 step 18.5 ms against 20.4. At 8 rows oneDNN wins.
:func:`head_blocks_pays` measures it for the model and row count at hand. The linear layers can run in one
block of rows per thread too (:func:`blocked_linear`, the pre-v2 code's route, measured faster on a Zen 3);
whole steps decide (on the Zen 4, 2.7% faster at batch 1: under the 3% the route asks, so not taken).
Either way a row's bits must not depend on its place among the rows, which is checked before a route is
taken (:func:`_same_in_every_position`).

**fp32 for bf16 without native bf16.** On a CPU without AVX-512 bf16 or AMX, oneDNN emulates bf16 products
and their time grows with the rows (measured before on a 2-core AMD EPYC Zen 3: GPT-2 124M's products 18 ms
at 1 row, 118 ms at 8, 6.9 s at 512; computed in fp32 on upcast pieces of the weight, a 512-token prefill
took 1.07 s instead of 5.07). :class:`UpcastBF16` runs bf16 products of at least ``min_rows`` rows in fp32
on 8 MiB pieces of upcast weight (they stay in cache and the allocator reuses them) and rounds the result to
bf16: the same fp32 sums in another order. A prompt's attention products (bf16 ``@`` in
``model/attention.py``) with at least ``min_rows`` queries run in fp32 too, rounded to bf16 once (GPT-2
124M, AVX2 and bf16 emulated on a Zen 4: a 512-token prompt 0.88 s instead of 2.7, of which oneDNN's
emulated bf16 batched products had taken 1.9). :func:`upcast_min_rows` checks the capability and,
where bf16 is emulated, measures from how many rows it pays. The eager decode step upcasts too, in
smaller pieces (``DECODE_PIECE_BYTES``) whose products run in one block of rows per thread, so that each
thread reads the half of a piece it converted (:func:`upcast_blocks_fit` checks that a row keeps its bits;
whole steps decide). Rows in an engine stay bitwise independent (a step's row count is fixed), but an engine
whose steps take an upcast route and one whose steps do not give a row different bits.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from model import GPT, KVCache
from model.embedding import TiedEmbedding


@functools.cache
def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN's inner product and it runs here (checked once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.inference_mode():
            y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), torch.ones(3, 2), None, "none", [], "")
        return torch.equal(y, torch.full((1, 3), 2.0))
    except (AttributeError, RuntimeError):
        return False


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the oneDNN route takes this product: fp32 on the CPU, a plain matrix weight."""
    return x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and weight.dim() == 2


class OneDNNLinear(TorchFunctionMode):
    """Within this mode, fp32 CPU ``F.linear`` calls run in oneDNN's inner product; others are unchanged."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            if _onednn_takes(x, weight):
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return _onednn_linear(x, weight, bias)
        return func(*args, **kwargs)


class _OneDNNLinearModule(nn.Linear):
    """An ``nn.Linear`` whose fp32 CPU products run in oneDNN's inner product (others as ``F.linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _onednn_takes(x, self.weight):
            return _onednn_linear(x, self.weight, self.bias)
        return super().forward(x)


class _OneDNNTiedEmbedding(TiedEmbedding):
    """A :class:`TiedEmbedding` whose fp32 CPU head product runs in oneDNN's inner product."""

    def project(self, x: torch.Tensor) -> torch.Tensor:
        if _onednn_takes(x, self.weight):
            return _onednn_linear(x, self.weight)
        return super().project(x)


def blocked_product(x: torch.Tensor, weight: torch.Tensor, blocks: int) -> torch.Tensor:
    """``x @ weight.T`` as one batched product over ``blocks`` blocks of the weight's rows: (..., in) ->
    (..., out), contiguous.

    Each block is its own product, so the threads stream separate stretches of the weight. For a wide
    head read by a few rows this runs near the machine's read bandwidth where one product does not: GPT-2
    124M's fp32 head (50,257 x 768), 1 row, 2 threads, medians: ``F.linear`` (MKL) 11.7 ms, oneDNN 5.8,
    4 blocks 4.8 on a Zen 4, 5.8 and 5.0 with AVX2 emulated there; at 8 rows oneDNN wins (9.9 against 16).
    The blocks are views of one shape: ``out // blocks`` rows apart, the last ending at the last row, so
    they overlap by ``out % blocks`` rows (each output is taken from one block). Rows past whole blocks are
    not computed apart: a product of one weight row in ``F.linear`` gave a row other bits in another
    position among the rows, which would break batch invariance.
    """
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    apart = out_features // blocks
    size = out_features - (blocks - 1) * apart  # apart, plus the rows past whole blocks
    parts = weight.as_strided((blocks, size, in_features), (apart * in_features, in_features, 1))
    y = torch.bmm(parts, rows.t().expand(blocks, in_features, rows.shape[0]))  # (blocks, size, rows)
    y = y.view(out_features, -1) if size == apart else torch.cat([y[:-1, :apart].flatten(0, 1), y[-1]])
    return y.t().contiguous().view(*x.shape[:-1], out_features)


class _BlockedTiedEmbedding(TiedEmbedding):
    """A :class:`TiedEmbedding` whose fp32 CPU head product runs in :attr:`blocks` row blocks
    (:func:`blocked_product`)."""

    blocks: int

    def project(self, x: torch.Tensor) -> torch.Tensor:
        if _blocks_take(x, self.weight, self.blocks):
            return blocked_product(x, self.weight, self.blocks)
        return super().project(x)


def _blocks_take(x: torch.Tensor, weight: torch.Tensor, blocks: int) -> bool:
    """Whether :func:`blocked_product` takes this product: fp32 on the CPU, a contiguous matrix weight with
    at least ``blocks`` rows."""
    return _onednn_takes(x, weight) and weight.is_contiguous() and weight.shape[0] >= blocks


def blocked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: int
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as one batched product of the rows by ``blocks`` contiguous blocks of
    the weight's rows, whose count ``blocks`` divides: (..., in) -> (..., out). The rows are on the left of
    each block's product, the layout that was faster for the body's products (the head's,
    :func:`blocked_product`, puts its long blocks on the left). The pre-v2 code ran fp32 decode products
    this way on a Zen 3, one block per thread: a GPT-2 124M batch-1 step 31.9 ms against 38.8 in oneDNN
    (768 x 768 and 768 x 3072 products 12 -> 16 and 17 -> 20 GB/s)."""
    out_features, in_features = weight.shape
    rows = x.reshape(1, -1, in_features).expand(blocks, -1, -1)
    parts = weight.view(blocks, out_features // blocks, in_features).transpose(1, 2)  # (blocks, in, out/b)
    y = torch.bmm(rows, parts) if bias is None else torch.baddbmm(bias.view(blocks, 1, -1), rows, parts)
    return y.transpose(0, 1).reshape(*x.shape[:-1], out_features)  # (blocks, R, out/b) -> (..., out)


def _divides(x: torch.Tensor, weight: torch.Tensor, blocks: int) -> bool:
    """Whether :func:`blocked_linear` takes this product: fp32 on the CPU, a contiguous matrix weight
    whose rows ``blocks`` divides."""
    return _onednn_takes(x, weight) and weight.is_contiguous() and weight.shape[0] % blocks == 0


class _BlockedLinearModule(nn.Linear):
    """An ``nn.Linear`` whose fp32 CPU products run in :attr:`blocks` row blocks (:func:`blocked_linear`)
    where they divide, else in oneDNN with :attr:`onednn`, else as ``F.linear``."""

    blocks: int
    onednn: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _divides(x, self.weight, self.blocks):
            return blocked_linear(x, self.weight, self.bias, self.blocks)
        if self.onednn and _onednn_takes(x, self.weight):
            return _onednn_linear(x, self.weight, self.bias)
        return super().forward(x)


def decode_copy(
    model: GPT,
    *,
    onednn: bool,
    head_blocks: int | None = None,
    body_blocks: int | None = None,
    upcast_blocks: int | None = None,
) -> GPT:
    """A copy of the model's modules that shares every parameter and buffer (no weight is copied), for the
    eager decode step's routes: with ``onednn``, its fp32 CPU linear products, the tied head's included, run
    in oneDNN's inner product (the products :class:`OneDNNLinear` routes, on the same kernel, without a
    mode's cost on every torch call: a pass-through mode made an eager GPT-2 124M int8 decode step at batch 1
    2.4 ms longer, on a 2-core Zen 4); with ``head_blocks``, its fp32 head runs in that many row blocks
    (:func:`blocked_product`), and with ``body_blocks`` its linear layers (:func:`blocked_linear`, where
    their outputs divide), whichever ``onednn`` says; with ``upcast_blocks``, its bf16 CPU products, the
    head's included, run in fp32 on upcast pieces of the weight in that many row blocks (one buffer of
    pieces for all: :class:`Pieces`). The model itself is left as it is."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    routed = copy.deepcopy(model, memo)
    pieces = Pieces()
    for module in routed.modules():
        if type(module) in (nn.Linear, TiedEmbedding) and upcast_blocks is not None:
            module.__class__ = _UpcastLinearModule if type(module) is nn.Linear else _UpcastTiedEmbedding
            module.blocks, module.pieces = upcast_blocks, pieces
        elif type(module) is nn.Linear and body_blocks is not None:
            module.__class__ = _BlockedLinearModule
            module.blocks, module.onednn = body_blocks, onednn
        elif type(module) is nn.Linear and onednn:
            module.__class__ = _OneDNNLinearModule
        elif type(module) is TiedEmbedding and head_blocks is not None:
            module.__class__ = _BlockedTiedEmbedding
            module.blocks = head_blocks
        elif type(module) is TiedEmbedding and onednn:
            module.__class__ = _OneDNNTiedEmbedding
    return routed


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


# fp32 bytes of weight upcast at a time: small enough to stay in cache and be reused by the allocator.
UPCAST_CHUNK_BYTES = 8 * 2**20


# fp32 bytes of weight the decode step's upcast route (:func:`decode_copy`'s ``upcast_blocks``) upcasts at a
# time. Each thread converts one half of a piece and then reads that half in the product: a piece stays in
# cache between the two, and a half read by the other core must cross between the cores. GPT-2 124M's 49
# decode products at 8 rows, AVX2 and bf16 emulated on a 2-core Zen 4 VM, against 51-58 ms in bf16: pieces
# of 8 MiB 31-43 ms while the two vCPUs shared an L3, but 54-58 once they did not (a read bandwidth of
# 55 GB/s instead of 32: the VM moves between the two); 2 MiB 35-41 and 45-47 ms.
DECODE_PIECE_BYTES = 2 * 2**20


class Pieces:
    """One fp32 buffer of ``nbytes`` that upcast products write their pieces of weight into, made at first
    use and kept, so that no piece is allocated (and its pages faulted in) afresh. Not for use by two
    threads at once."""

    def __init__(self, nbytes: int = DECODE_PIECE_BYTES) -> None:
        self.nbytes = nbytes
        self._buffer: torch.Tensor | None = None

    def take(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` upcast into the buffer (a view of it), or into a tensor of its own if it is larger."""
        if weight.numel() > self.nbytes // 4:
            return weight.float()
        if self._buffer is None or self._buffer.device != weight.device:
            self._buffer = torch.empty(self.nbytes // 4, device=weight.device)
        return self._buffer[: weight.numel()].view(weight.shape).copy_(weight)


def _upcast_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    blocks: int | None = None,
    pieces: Pieces | None = None,
) -> torch.Tensor:
    """A bf16 product computed in fp32, ``UPCAST_CHUNK_BYTES`` (with ``pieces``, its ``nbytes``) of upcast
    weight rows at a time, rounded to bf16. With ``blocks``, each piece's product runs in that many row
    blocks (:func:`blocked_linear`, or :func:`blocked_product` for a piece whose rows ``blocks`` does not
    divide; the decode step's route, one block per thread); with ``pieces``, the pieces are upcast into its
    buffer. Every piece's product keeps a
    row's bits wherever the row stands among the rows, as the blocks' batched products do (checked on the
    machine before the decode route is taken: :func:`upcast_blocks_fit`)."""
    x32 = x.float()
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    step = max(1, (UPCAST_CHUNK_BYTES if pieces is None else pieces.nbytes) // (4 * weight.shape[1]))
    if blocks is not None:
        step = max(blocks, step // blocks * blocks)
    for a in range(0, weight.shape[0], step):
        piece = weight[a : a + step]
        piece = piece.float() if pieces is None else pieces.take(piece)
        b = None if bias is None else bias[a : a + step].float()
        if blocks is None:
            y = F.linear(x32, piece, b)
        elif len(piece) % blocks == 0:
            y = blocked_linear(x32, piece, b, blocks)
        else:  # (blocked_product's blocks overlap; a piece of fewer rows takes a block a row)
            y = blocked_product(x32, piece, min(blocks, len(piece)))
            y = y if b is None else y + b
        out[..., a : a + step] = y
    return out


class _UpcastLinearModule(nn.Linear):
    """An ``nn.Linear`` whose bf16 CPU products run in fp32 on upcast pieces of its weight in :attr:`blocks`
    row blocks (:func:`_upcast_linear`); others as ``F.linear``."""

    blocks: int
    pieces: Pieces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _bf16_cpu(x, self.weight) and self.weight.dim() == 2:
            return _upcast_linear(x, self.weight, self.bias, self.blocks, self.pieces)
        return super().forward(x)


class _UpcastTiedEmbedding(TiedEmbedding):
    """A :class:`TiedEmbedding` whose bf16 CPU head product runs as :class:`_UpcastLinearModule`'s do."""

    blocks: int
    pieces: Pieces

    def project(self, x: torch.Tensor) -> torch.Tensor:
        if _bf16_cpu(x, self.weight) and self.weight.dim() == 2:
            return _upcast_linear(x, self.weight, None, self.blocks, self.pieces)
        return super().project(x)


def _upcast_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A bf16 ``x @ y`` computed in fp32 and rounded to bf16 once, as the bf16 product rounds its sums."""
    return torch.matmul(x.float(), y.float()).to(torch.bfloat16)


_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)  # (``x @ y`` is the method's)


def _bf16_cpu(*tensors: object) -> bool:
    return all(
        isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors
    )


class UpcastBF16(TorchFunctionMode):
    """Within this mode, bf16 CPU ``F.linear`` calls of at least ``min_rows`` rows run in fp32 on upcast
    pieces of the weight, and bf16 CPU matrix products (``@``, ``torch.matmul``: a prompt's attention) whose
    left operand has at least ``min_rows`` rows run in fp32 on upcast operands (see the module docstring);
    others are unchanged."""

    def __init__(self, min_rows: int) -> None:
        super().__init__()
        self.min_rows = min_rows

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            if (
                _bf16_cpu(x, weight)
                and weight.dim() == 2
                and x.numel() // max(x.shape[-1], 1) >= self.min_rows
            ):
                return _upcast_linear(x, weight, args[2] if len(args) > 2 else kwargs.get("bias"))
        elif func in _MATMULS:
            x, y = args[0], args[1] if len(args) > 1 else kwargs["other"]
            if _bf16_cpu(x, y) and min(x.dim(), y.dim()) >= 2 and x.shape[-2] >= self.min_rows and not kwargs:
                return _upcast_matmul(x, y)
        return func(*args, **kwargs)


@functools.cache
def bf16_native() -> bool:
    """Whether this CPU has native bf16 arithmetic for oneDNN (AVX-512 bf16 or AMX); checked once."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def bf16_emulated(model: GPT) -> bool:
    """Whether ``model`` is a bf16 model on a CPU without native bf16 whose linear layers hold bf16 weights
    (quantized layers have their own kernels): the models the upcast routes are for."""
    if model.device.type != "cpu" or model.compute_dtype != torch.bfloat16 or bf16_native():
        return False
    layers = [m for m in model.h[0].modules() if isinstance(m, nn.Linear)]
    weights = [getattr(m, "weight", None) for m in layers]
    return bool(layers) and all(isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 for w in weights)


def upcast_blocks_fit(model: GPT, rows: int, blocks: int) -> bool:
    """Whether the decode step's bf16 products can run in fp32 on upcast pieces in ``blocks`` row blocks
    (:func:`decode_copy`'s ``upcast_blocks``) at ``rows`` rows: a model :func:`bf16_emulated` says the upcast
    routes are for, ``blocks`` > 1, and each of a block's linear layers and the head giving a row the same
    bits in every position among the rows (:func:`_same_in_every_position`). Whether it pays is left to whole
    steps (GPT-2 124M's products alone at 8 rows, AVX2 and bf16 emulated on a Zen 4: 37-43 ms against 51-62
    in bf16; at 1 row 16 against 8)."""
    if blocks < 2 or not bf16_emulated(model):
        return False
    layers = [(m.weight, m.bias) for m in model.h[0].modules() if isinstance(m, nn.Linear)]
    pieces = Pieces()  # (the route's pieces: their rows are the products' shapes)
    with torch.inference_mode():
        return all(
            _same_in_every_position(
                _upcast_linear, torch.randn(rows, 1, w.shape[1]).bfloat16(), w, b, blocks, pieces
            )
            for w, b in [*layers, (model.wte.weight, None)]
        )


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
