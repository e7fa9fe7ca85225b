"""Eager kernel routes, chosen on the machine that runs them; ``model/`` itself only calls ``F.linear``.

Prefill's routes (oneDNN for fp32 products, fp32 for bf16 products) are modes
(:class:`~torch.overrides.TorchFunctionMode`) the runner enters around eager calls. A mode costs microseconds
on every torch call, so the bf16 mode is entered only where a product reaches its row count, and the eager
decode step's routes (oneDNN, and row blocks for the head and the linear layers, in fp32; the upcast route in
bf16) are a copy of the model's modules, sharing its tensors, whose layers call their kernels themselves
(:func:`decode_copy`).

**oneDNN for fp32 decode.** fp32 products of the eager decode step on the CPU can run in oneDNN's inner
product (``torch.ops.mkldnn._linear_pointwise``, the kernel ``torch.compile`` uses for CPU linears) instead of
``F.linear`` (MKL). On a 2-core AMD EPYC Zen 4, one row (batch 1), GPT-2 124M's products took: head (50257 x
768) MKL 12.0 ms, oneDNN 6.1 ms; 3072 x 768 0.18 vs 0.09 ms; 768 x 768 about equal. Whether it pays depends on
the CPU and the row count, so :func:`generate.probes.onednn_pays` measures it for the model at hand when an
eager engine is made. Like MKL's, oneDNN's sums for a row depend on how many rows the product has, not on the
other rows' values, so rows stay bitwise independent within an engine either way.

**Row blocks for the fp32 head in decode.** A wide head read by a few rows runs faster as one batched product
over a few contiguous blocks of its rows (:func:`blocked_product`): GPT-2 124M's head at 1 row 4.8 ms against
oneDNN's 5.8 on the Zen 4, and a batch-1 step 18.5 ms against 20.4. At 8 rows oneDNN wins.
:func:`generate.probes.head_blocks_pays` measures it for the model and row count at hand. The linear layers
can run in one block of rows per thread too (:func:`blocked_linear`, the pre-v2 code's route, measured faster
on a Zen 3); whole steps decide (on the Zen 4, 2.7% faster at batch 1: under the 3% the route asks, so not
taken). Either way a row's bits must not depend on its place among the rows, which is checked before a route
is taken (:func:`generate.probes._same_in_every_position`).

**fp32 for bf16 without native bf16.** On a CPU without AVX-512 bf16 or AMX, oneDNN emulates bf16 products and
their time grows with the rows (measured before on a 2-core AMD EPYC Zen 3: GPT-2 124M's products 18 ms at 1
row, 118 ms at 8, 6.9 s at 512; computed in fp32 on upcast pieces of the weight, a 512-token prefill took 1.07
s instead of 5.07). :class:`UpcastBF16` runs bf16 products of at least ``min_rows`` rows in fp32 on 8 MiB
pieces of upcast weight (they stay in cache and the allocator reuses them) and rounds the result to bf16: the
same fp32 sums in another order. A prompt's attention products (bf16 ``@`` in ``model/attention.py``) with at
least ``min_rows`` queries run in fp32 too, rounded to bf16 once (GPT-2 124M, AVX2 and bf16 emulated on a Zen
4: a 512-token prompt 0.88 s instead of 2.7, of which oneDNN's emulated bf16 batched products had taken 1.9).
:func:`generate.probes.upcast_min_rows` checks the capability and, where bf16 is emulated, measures from how
many rows it pays. The eager decode step upcasts too (its bf16 products: an int8-body or int4-body model's
head, a bf16 model's every product), in smaller pieces whose products run in one block of rows per thread, so
that each thread reads the share of a piece it converted; the piece size is measured
(:func:`generate.probes.upcast_pieces_fastest`, of ``DECODE_PIECE_SIZES``),
:func:`generate.probes.upcast_blocks_fit` checks that a row keeps its bits, and whole steps decide. Rows in an
engine stay bitwise independent (a step's row count is fixed), but an engine whose steps take an upcast route
and one whose steps do not give a row different bits.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from model import GPT
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
    y = _by_blocks(x.reshape(1, -1, in_features).expand(blocks, -1, -1), weight, bias, blocks)
    return y.transpose(0, 1).reshape(*x.shape[:-1], out_features)  # (blocks, R, out/b) -> (..., out)


def _by_blocks(
    rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: int
) -> torch.Tensor:
    """:func:`blocked_linear`'s product: (blocks, R, in) rows (one row set, expanded) by ``blocks``
    contiguous blocks of the weight's rows, plus their bias -> (blocks, R, out / blocks)."""
    out_features, in_features = weight.shape
    parts = weight.view(blocks, out_features // blocks, in_features).transpose(1, 2)  # (blocks, in, out/b)
    return torch.bmm(rows, parts) if bias is None else torch.baddbmm(bias.view(blocks, 1, -1), rows, parts)


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
    upcast_pieces: int | None = None,
) -> GPT:
    """A copy of the model's modules that shares every parameter and buffer (no weight is copied), for the
    eager decode step's routes: with ``onednn``, its fp32 CPU linear products, the tied head's included, run
    in oneDNN's inner product (the products :class:`OneDNNLinear` routes, on the same kernel, without a
    mode's cost on every torch call: a pass-through mode made an eager GPT-2 124M int8 decode step at batch 1
    2.4 ms longer, on a 2-core Zen 4); with ``head_blocks``, its fp32 head runs in that many row blocks
    (:func:`blocked_product`), and with ``body_blocks`` its linear layers (:func:`blocked_linear`, where
    their outputs divide), whichever ``onednn`` says; with ``upcast_blocks``, its bf16 CPU products, the
    head's included, run in fp32 on upcast pieces of the weight, ``upcast_pieces`` fp32 bytes each, in that
    many row blocks (one buffer of pieces for all: :class:`Pieces`). The model itself is left as it is.

    Raises:
        ValueError: if ``upcast_blocks`` comes with an fp32 route (its layers would take the upcast ones) or
            without ``upcast_pieces``.
    """
    if upcast_blocks is not None and upcast_pieces is None:
        raise ValueError(
            f"upcast_blocks={upcast_blocks} needs upcast_pieces (fp32 bytes a piece), e.g. 3 * 2**20"
        )
    if upcast_blocks is not None and (onednn or head_blocks is not None or body_blocks is not None):
        raise ValueError(
            f"upcast_blocks={upcast_blocks} is a bf16 route and takes every layer; give it without onednn "
            f"({onednn}), head_blocks ({head_blocks}) and body_blocks ({body_blocks})"
        )
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    routed = copy.deepcopy(model, memo)
    pieces = None if upcast_pieces is None else Pieces(upcast_pieces)  # (used only with upcast_blocks)
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


# fp32 bytes of weight upcast at a time: small enough to stay in cache and be reused by the allocator.
UPCAST_CHUNK_BYTES = 8 * 2**20


# The fp32 piece sizes the decode step's upcast route (:func:`decode_copy`'s ``upcast_blocks``) may upcast at
# a time; :func:`generate.probes.upcast_pieces_fastest` measures which is fastest on the machine. Each thread
# converts its share of a piece and then reads that share in the product (one block per thread): a piece stays
# in cache between the two, and a share read by another core would have to cross between them. The best size
# depends on the caches and on the products' shapes: GPT-2 124M's 49 decode products at 8 rows, AVX2 and bf16
# emulated on a 2-vCPU Zen 4 VM, against 50-54 ms in bf16: 3 MiB pieces (1,024 rows of 768) 32-41 ms while the
# two vCPUs shared an L3 and 40-45 while they did not (the VM moves between the two), 2 MiB 37-50 and 50-54,
# 8 MiB 31-34 and 57-65.
DECODE_PIECE_SIZES = tuple(n * 2**20 for n in (1, 2, 3, 4, 6, 8))


class Pieces:
    """One fp32 buffer of ``nbytes`` that upcast products write their pieces of weight into, made at first
    use and kept, so that no piece is allocated (and its pages faulted in) afresh. Not for use by two
    threads at once."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buffer: torch.Tensor | None = None

    def take(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` upcast into the buffer (a view of it), or into a tensor of its own if it is larger."""
        if weight.numel() > self.nbytes // 4:
            return weight.float()
        if self._buffer is None or self._buffer.device != weight.device:
            self._buffer = torch.empty(self.nbytes // 4, dtype=torch.float32, device=weight.device)
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
    divide; the decode step's route, one block per thread), which give a row the same bits wherever it
    stands among the rows (checked on the machine before the route is taken:
    :func:`generate.probes.upcast_blocks_fit`); with ``pieces``, the pieces are upcast into its buffer."""
    step = max(1, (UPCAST_CHUNK_BYTES if pieces is None else pieces.nbytes) // (4 * weight.shape[1]))
    if blocks is not None:
        return _upcast_blocks(x, weight, bias, blocks, max(blocks, step // blocks * blocks), pieces)
    x32 = x.float()
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    for a in range(0, weight.shape[0], step):
        piece = weight[a : a + step]
        piece = piece.float() if pieces is None else pieces.take(piece)
        b = None if bias is None else bias[a : a + step].float()
        out[..., a : a + step] = F.linear(x32, piece, b)
    return out


def _upcast_blocks(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    blocks: int,
    step: int,
    pieces: Pieces | None,
) -> torch.Tensor:
    """:func:`_upcast_linear` in ``blocks`` row blocks, ``step`` weight rows (a multiple of ``blocks``) a
    piece: :func:`blocked_linear`'s product, with the operands it would make made once a call and each
    piece's result rounded straight into the output (the decode step runs a few hundred pieces: GPT-2 124M's
    49 products at 8 rows in 2 MiB pieces, AVX2 and bf16 emulated on a Zen 4, 2 ms less a step so)."""
    out_features, in_features = weight.shape
    x32 = x.reshape(1, -1, in_features).float().expand(blocks, -1, -1)  # (blocks, R, in), as blocked_linear's
    rows = x32.shape[1]
    bias32 = None if bias is None else bias.float()
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    for a in range(0, out_features, step):
        piece = weight[a : a + step]
        piece = piece.float() if pieces is None else pieces.take(piece)
        n = len(piece)
        if n % blocks == 0:
            y = _by_blocks(x32, piece, None if bias32 is None else bias32[a : a + n], blocks)
            out[:, a : a + n].view(rows, blocks, n // blocks).copy_(y.transpose(0, 1))
        else:  # (blocked_product's blocks overlap; a piece of fewer rows takes a block a row)
            y = blocked_product(x32[0], piece, min(blocks, n))
            out[:, a : a + n] = y if bias32 is None else y + bias32[a : a + n]
    return out.view(*x.shape[:-1], out_features)


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
