"""Linear layers for decode steps: the matrix-vector products that bound generation speed on a CPU.

In a decode step each weight matrix is read once to multiply a handful of rows, so the step's time is the
time to stream the weights from memory. Two things decide how fast PyTorch's CPU kernels (MKL) stream them:

- Layout. An fp32 weight with more outputs than inputs (``c_attn``, ``c_fc``, the 50,257-row output head)
  reads faster stored column-major, as ``(in, out)`` in memory, which is also how GPT-2 checkpoints store
  the Conv1D matrices. Measured on 2 AMD EPYC (Zen 3) cores: the head's one-row product 13.6 -> 8.3 ms, and
  a GPT-2 124M decode step 39.4 -> 33.5 ms at batch 1, 125 -> 99 ms at batch 8 (with the split below).
  In bf16 the opposite holds (a column-major 512 x 768 x 2304 product took 1.5 s, row-major 91 ms), so
  :func:`fit_layout` picks the order from the dtype, at construction and after every ``.to()``. The shape
  stays ``(out, in)``: nothing outside this file sees the difference.
- Threads. PyTorch's small-batch products do not use both cores well: :class:`Linear` splits products of at
  most ``SPLIT_MAX_ROWS`` rows by output rows across threads; each thread computes whole dot products, so
  the result is the same as the unsplit product. Beyond 4 rows splitting measured slower than not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

# Split only products with at most this many input rows (decode steps of small batches). Measured on a
# GPT-2 124M decode step: splitting batch 8 cost 10-40% (its products use both cores), batch 2-4 gained.
SPLIT_MAX_ROWS = 4


def prefers_column_major(weight: torch.Tensor) -> bool:
    """Whether ``F.linear`` reads this ``(out, in)`` weight faster column-major: fp32 with ``out >= in``."""
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


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gptgen-linear")


def _linear_no_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():  # grad mode is per thread: the pool's threads must not record autograd either
        return F.linear(x, weight, bias)


def split_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight's rows split into ``parts`` products run concurrently."""
    weights = weight.chunk(parts)
    biases = bias.chunk(parts) if bias is not None else [None] * parts
    pool = _pool(parts - 1)
    futures = [pool.submit(_linear_no_grad, x, w, b) for w, b in zip(weights[1:], biases[1:], strict=True)]
    first = F.linear(x, weights[0], biases[0])  # the calling thread does one part itself
    return torch.cat([first, *(f.result() for f in futures)], dim=-1)


def _splits(x: torch.Tensor, weight: torch.Tensor) -> int:
    """How many threads to split this product over (1: do not split)."""
    if weight.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return 1
    if x.numel() // x.shape[-1] > SPLIT_MAX_ROWS:
        return 1
    return min(torch.get_num_threads(), max(1, weight.shape[0] // 256))


class Linear(nn.Linear):
    """``nn.Linear`` whose weight is laid out by :func:`fit_layout` and whose small-batch fp32 inference
    products are split across threads (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs: object) -> None:
        super().__init__(in_features, out_features, bias, **kwargs)
        fit_layout(self.weight)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Linear:
        super()._apply(fn, recurse)
        fit_layout(self.weight)  # .to(dtype) keeps strides, but the fastest order depends on the dtype
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = _splits(x, self.weight)
        if parts > 1:
            return split_linear(x, self.weight, self.bias, parts)
        return F.linear(x, self.weight, self.bias)


class TiedEmbedding(nn.Embedding):
    """The token embedding, which is also the output head: :meth:`project` maps hidden states to logits.

    Its ``(vocab_size, n_embd)`` weight is laid out by :func:`fit_layout` for the head's product (in fp32,
    column-major); looking up a few token rows then reads strided memory, which costs little.
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
        parts = _splits(x, self.weight)
        return split_linear(x, self.weight, None, parts) if parts > 1 else F.linear(x, self.weight)
