"""Linear layers for decode steps: the matrix-vector products that bound generation speed on a CPU.

In a decode step each weight matrix is read once to multiply a handful of rows, so the step's time is the
time to stream the weights from memory. How fast PyTorch's CPU kernels stream them was measured on the
2-core AMD EPYC (Zen 3) machine this was written on:

- Row blocks, one per thread. ``F.linear`` runs small-batch fp32 products in MKL on one thread (10-16
  GB/s). Splitting the row-major ``(out, in)`` weight into one contiguous block of rows per thread and
  running the blocks as one batched product (``torch.bmm``, which runs the blocks in parallel: 24 products
  of 3072 x 768 read 10.8 GB/s as one block on 2 threads, 17.7 as two) lets every thread stream its own
  stretch of memory. :func:`linear` does this for fp32 CPU inference products of at
  most ``BLOCKED_MAX_ROWS`` rows whose output count the thread count divides (measured on 2 threads only;
  elsewhere, e.g. 5 or 7 threads and GPT-2's 768 outputs, products go to oneDNN). GPT-2 124M on 2 threads,
  against oneDNN's inner product (the route before, see below), medians of 6 alternated runs: a decode step
  at batch 1 38.8 -> 31.9 ms, at batch 8 82.8 -> 76.1 ms; a 64-token prefill 166 -> 133 ms. The gain is in
  the products with no more outputs than inputs (768 x 768 and 768 x 3072: 12 -> 16 and 17 -> 20 GB/s).
- oneDNN. ``torch.ops.mkldnn._linear_pointwise`` (what ``torch.compile`` uses for CPU linears) reads a plain
  weight in place and uses both cores. It takes the fp32 products of at most ``ONEDNN_MAX_ROWS`` rows that
  do not run in row blocks: the output head (stored column-major, see below), weights whose rows the
  threads do not divide, and everything on a single thread.
- Layout. The head's weight reads faster stored column-major, as ``(in, out)`` in memory, in fp32 (one-row
  products 7.97 ms column-major, 9.84 ms row-major, 9.26 ms in row blocks), and row-major in bf16 (a
  column-major 512 x 768 x 2304 bf16 product took 1.5 s, row-major 91 ms): :func:`fit_layout` picks the
  order from the dtype, at construction and after every ``.to()``; the shape stays ``(out, in)``. The other
  linear layers stay row-major, which the row blocks need and MKL's long-prompt products do not mind
  (prefill of 512 tokens 896 -> 790 ms, against column-major storage of the wide ones).

- bf16 without native bf16. On a CPU without AVX-512 bf16 or AMX, oneDNN emulates bf16 products, and their
  time grows with the rows (GPT-2 124M's products: 18 ms at 1 row, 118 ms at 8, 6.9 s at 512). There
  :func:`linear` runs inference products of at least ``UPCAST_MIN_ROWS`` rows in fp32 on copies of the
  weight made piece by piece (8 MiB of fp32 at a time, so a copy stays in cache and its memory is reused),
  and rounds the result to bf16: the same fp32 sums in another order. GPT-2 124M in bf16 here: prefill of
  512 tokens 5.07 -> 1.07 s, of 128 tokens 1.32 -> 0.33 s; a decode step at batch 8 133 -> 107 ms, at
  batch 16 251 -> 128 ms; at batch 4 the copies cost more than they save (73 -> 92 ms).

Splitting products across a Python thread pool, tried before, gained nothing next to the kernels' own
threads and fought them (0.4 tok/s), so it is gone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def prefers_column_major(weight: torch.Tensor) -> bool:
    """Whether the tied head's products read this ``(out, in)`` weight faster column-major: fp32 with
    ``out >= in``. (The other linear layers stay row-major for the row blocks.)"""
    return weight.dtype == torch.float32 and weight.shape[0] >= weight.shape[1]


def fit_layout(weight: nn.Parameter) -> None:
    """Store ``weight`` in the memory order its products read fastest, in place.

    Values, shape and the Parameter object are kept (an optimizer holding it is unaffected); only the
    strides change. Column-major means the transpose is contiguous.
    """
    data = weight.data
    if prefers_column_major(data):
        if not data.t().is_contiguous():
            weight.data = data.t().contiguous().t()
    elif not data.is_contiguous():
        weight.data = data.contiguous()


# fp32 products of at most this many rows run in row blocks (where they divide) and, failing that, in
# oneDNN; longer prompts in MKL. GPT-2 124M forwards: row blocks / MKL time 0.84 at 64 rows, ~1 at 128 and
# 512; oneDNN / MKL 0.74 at 8 rows, 0.80 at 32, 1.10 at 64, 1.28 at 512.
BLOCKED_MAX_ROWS = 64
ONEDNN_MAX_ROWS = 32


def _row_blocks(weight: torch.Tensor) -> int:
    """How many row blocks a product of ``weight`` runs in: one per thread, or 0 where that cannot be (a
    single thread, a row count the threads do not divide, a weight that is not row-major)."""
    threads = torch.get_num_threads()
    if threads > 1 and weight.shape[0] % threads == 0 and weight.is_contiguous():
        return threads
    return 0


def _blocked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: int
) -> torch.Tensor:
    """``F.linear`` as one batched product over ``blocks`` contiguous row blocks of ``weight``."""
    out_features, in_features = weight.shape
    rows = x.reshape(1, x.numel() // max(in_features, 1), in_features).expand(blocks, -1, -1)
    w = weight.view(blocks, out_features // blocks, in_features).transpose(1, 2)  # (blocks, in, out/blocks)
    y = torch.bmm(rows, w) if bias is None else torch.baddbmm(bias.reshape(blocks, 1, -1), rows, w)
    return y.transpose(0, 1).reshape(*x.shape[:-1], out_features)  # (blocks, R, out/blocks) -> (..., out)


@functools.cache
def _onednn_works() -> bool:
    """Whether this PyTorch build has oneDNN's inner product and it runs here (checked once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad():
            x, w = torch.ones(1, 2), torch.ones(3, 2)
            y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return torch.equal(y, torch.full((1, 3), 2.0))
    except (AttributeError, RuntimeError):
        return False


# On a CPU without native bf16, bf16 inference products of at least this many rows run in fp32 on upcast
# pieces of the weight (see the module docstring); GPT-2 124M decode steps break even at 5-7 rows.
UPCAST_MIN_ROWS = 8
# fp32 bytes of weight upcast at a time: small enough to stay in cache and be reused by the allocator.
UPCAST_CHUNK_BYTES = 8 * 2**20


@functools.cache
def _bf16_emulated() -> bool:
    """Whether this CPU lacks native bf16 arithmetic (checked once)."""
    try:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, with CPU inference routes (see the module docstring): fp32 products
    of few rows run in row blocks, one per thread, or else in oneDNN; bf16 products of many rows on a CPU
    without native bf16 run in fp32."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if x.dtype == torch.float32 and rows <= BLOCKED_MAX_ROWS:
        blocks = _row_blocks(weight)
        if blocks:
            return _blocked_linear(x, weight, bias, blocks)
        if rows <= ONEDNN_MAX_ROWS and torch.backends.mkldnn.enabled and _onednn_works():
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if x.dtype == torch.bfloat16 and rows >= UPCAST_MIN_ROWS and _bf16_emulated():
        return _upcast_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A bf16 product computed in fp32, ``UPCAST_CHUNK_BYTES`` of upcast weight rows at a time."""
    x32 = x.float()
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    step = max(1, UPCAST_CHUNK_BYTES // (4 * weight.shape[1]))
    for a in range(0, weight.shape[0], step):
        piece_bias = None if bias is None else bias[a : a + step].float()
        out[..., a : a + step] = linear(x32, weight[a : a + step].float(), piece_bias)
    return out


class Linear(nn.Linear):
    """``nn.Linear`` whose products run in :func:`linear`; its weight stays row-major, as the row blocks
    need."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class TiedEmbedding(nn.Embedding):
    """The token embedding, which is also the output head: :meth:`project` maps hidden states to logits.

    Its ``(vocab_size, n_embd)`` weight is laid out by :func:`fit_layout` for the head's product (in fp32,
    column-major), at construction and after every ``.to()``/``to_empty()`` (a cast keeps strides, but the
    fastest order depends on the dtype); looking up a few token rows then reads strided memory, which costs
    little.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, **kwargs: object) -> None:
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        fit_layout(self.weight)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> TiedEmbedding:
        super()._apply(fn, recurse)
        fit_layout(self.weight)
        return self

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``x @ weight.T``, (..., n_embd) -> (..., vocab_size)."""
        return linear(x, self.weight)
