"""Linear layers for decode steps: the matrix-vector products that bound generation speed on a CPU.

In a decode step each weight matrix is read once to multiply a handful of rows, so the step's time is the
time to stream the weights from memory. Two things decide how fast PyTorch's CPU kernels stream them:

- Kernel. ``F.linear`` runs small-batch fp32 products in MKL, which on the AMD EPYC (Zen 3) machine this
  was measured on reads the weights at 10-16 GB/s on one thread and is slow for 2-16 rows. oneDNN's inner
  product (``torch.ops.mkldnn._linear_pointwise``, what ``torch.compile`` uses for CPU linears) reads a
  plain weight in place, with no packing or copy, and uses both cores: GPT-2 124M's 49 products took
  31.3 -> 26.3 ms at 1 row and 119 -> 66 ms at 8 rows; a GPT-2 124M decode at batch 8 went 54-64 -> 100
  tok/s. For long prompts MKL is faster, so :func:`linear` sends fp32 CPU inference products of at most
  ``ONEDNN_MAX_ROWS`` rows there and everything else (long prompts, training, bf16, CUDA) to ``F.linear``.
- Layout. An fp32 weight with more outputs than inputs (``c_attn``, ``c_fc``, the 50,257-row output head)
  reads faster stored column-major, as ``(in, out)`` in memory, which is also how GPT-2 checkpoints store
  the Conv1D matrices: one-row products of all 124M weights took 29.3 ms row-major and 26.3 ms
  column-major in oneDNN (42 and 31 ms in MKL). In bf16 the opposite holds (a column-major
  512 x 768 x 2304 product took 1.5 s, row-major 91 ms), so :func:`fit_layout` picks the order from the
  dtype, at construction and after every ``.to()``. The shape stays ``(out, in)``: nothing outside this
  file sees the difference.

- bf16 without native bf16. On a CPU without AVX-512 bf16 or AMX, oneDNN emulates bf16 products, and
  their time grows with the rows (GPT-2 124M's products: 18 ms at 1 row, 118 ms at 8, 6.9 s at 512). There
  :func:`linear` runs inference products of at least ``UPCAST_MIN_ROWS`` rows in fp32 on copies of the
  weight made piece by piece (8 MiB of fp32 at a time, so a copy stays in cache and its memory is reused),
  and rounds the result to bf16: the same fp32 sums in another order. GPT-2 124M in bf16 here: prefill of
  512 tokens 5.07 -> 1.07 s, of 128 tokens 1.32 -> 0.33 s; a decode step at batch 8 133 -> 107 ms, at
  batch 16 251 -> 128 ms; at batch 4 the copies cost more than they save (73 -> 92 ms).

Splitting products across a Python thread pool, tried before, gained nothing next to oneDNN's own threads
and fought them (0.4 tok/s), so it is gone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def prefers_column_major(weight: torch.Tensor) -> bool:
    """Whether products read this ``(out, in)`` weight faster column-major: fp32 with ``out >= in``."""
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


# Products of at most this many rows (decode steps, short prompts) run in oneDNN; longer prompts in MKL.
# Measured on GPT-2 124M forwards, oneDNN / MKL time: 0.74 at 8 rows, 0.80 at 32, 1.10 at 64, 1.28 at 512.
ONEDNN_MAX_ROWS = 32


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
    """``F.linear(x, weight, bias)``, with two CPU inference routes (see the module docstring): fp32
    products of few rows run in oneDNN, and bf16 products of many rows on a CPU without native bf16 run
    in fp32."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if (
        x.dtype == torch.float32
        and rows <= ONEDNN_MAX_ROWS
        and torch.backends.mkldnn.enabled
        and _onednn_works()
    ):
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


class _LaidOut(nn.Module):
    """Re-fits ``self.weight``'s layout after every ``.to()``/``to_empty()``: a cast keeps strides, but
    the fastest order depends on the dtype."""

    weight: nn.Parameter

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> _LaidOut:
        super()._apply(fn, recurse)
        fit_layout(self.weight)
        return self


class Linear(_LaidOut, nn.Linear):
    """``nn.Linear`` whose weight is laid out by :func:`fit_layout`; products run in :func:`linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs: object) -> None:
        super().__init__(in_features, out_features, bias, **kwargs)
        fit_layout(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class TiedEmbedding(_LaidOut, nn.Embedding):
    """The token embedding, which is also the output head: :meth:`project` maps hidden states to logits.

    Its ``(vocab_size, n_embd)`` weight is laid out by :func:`fit_layout` for the head's product (in fp32,
    column-major); looking up a few token rows then reads strided memory, which costs little.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, **kwargs: object) -> None:
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        fit_layout(self.weight)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``x @ weight.T``, (..., n_embd) -> (..., vocab_size)."""
        return linear(x, self.weight)
