"""Linear layers for decode steps: the matrix-vector products that bound generation speed on a CPU.

In a decode step each weight matrix is read once to multiply a handful of rows, so the step's time is the
time to stream the weights from memory. PyTorch's fp32 matrix-vector product runs on one thread, which
reads memory at about two thirds of what two cores can (measured here: 22.7 vs 35.6 GB/s on GPT-2 124M's
matrices). :class:`Linear` splits such products by output rows across threads; each thread computes whole
dot products, so the result is the same as the unsplit product.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

# Split only products with at most this many input rows (decode steps of small batches): larger ones are
# matrix-matrix products that PyTorch already spreads over its threads.
SPLIT_MAX_ROWS = 8


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
    """``nn.Linear`` whose small-batch fp32 inference products are split across threads (see module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = _splits(x, self.weight)
        if parts > 1:
            return split_linear(x, self.weight, self.bias, parts)
        return F.linear(x, self.weight, self.bias)


class TiedEmbedding(nn.Embedding):
    """The token embedding, which is also the output head: :meth:`project` maps hidden states to logits."""

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``x @ weight.T``, (..., n_embd) -> (..., vocab_size)."""
        parts = _splits(x, self.weight)
        return split_linear(x, self.weight, None, parts) if parts > 1 else F.linear(x, self.weight)
