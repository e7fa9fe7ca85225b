"""Int8 weight-only quantization: int8 matrices with one bf16 scale per output row, bf16 activations.

A decode step's time is the time to read the weights; int8 halves the bytes of bf16 (quarter of fp32). A
product of a few rows runs in ``torch.ops.aten._weight_int8pack_mm``, which reads the int8 weights and scales
directly; from :data:`DEQUANT_ROWS` rows (a prompt), a kernel that works row by row is the slower way, so the
weights are turned into bf16 a block of :data:`ROWS_PER_PASS` output rows at a time (int8 is exact in bf16)
for the bf16 matrix product, and the scales applied to its bf16 output (one rounding more than the kernel):
1.6-4x faster on 32-512 rows (AMD Zen 4), never a second whole copy of the weights. The rule is by shape, so
a product's bits follow from its shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.gpt import TiedEmbedding

COMPUTE_DTYPE = torch.bfloat16


# Rows quantized (or turned into bf16 for a product) per pass: bounds the temporary (4096 rows of 768: 12 MiB
# in fp32; GPT-2's head has 50,257).
ROWS_PER_PASS = 4096
DEQUANT_ROWS = 16  # input rows from which a product runs in bf16 (about where the two ways cost the same)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``weight ~= q * scale[:, None]`` with ``q`` in [-127, 127].

    Returns:
        ``(q, scale)``: int8 (N, K) and bf16 (N,).
    """
    w = weight.detach().float()
    low, high = w.aminmax(dim=1)  # the largest magnitude per row, without an abs() copy of the matrix
    scale = (torch.maximum(-low, high) / 127.0).clamp(min=1e-12)
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    for start in range(0, w.shape[0], ROWS_PER_PASS):
        rows = slice(start, start + ROWS_PER_PASS)
        q[rows] = (w[rows] / scale[rows, None]).round_().clamp_(-127, 127)
    return q, scale.to(COMPUTE_DTYPE)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, K) in the compute dtype, the quantized kernels' input. (A ``.to`` that changes nothing
    still costs a call: 1 us, about 50 us in a GPT-2 124M decode step.)"""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.dtype == COMPUTE_DTYPE else rows.to(COMPUTE_DTYPE)


def _int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows = as_rows(x)
    if rows.shape[0] < DEQUANT_ROWS:
        y = torch.ops.aten._weight_int8pack_mm(rows, q, scale)
    else:
        blocks = range(0, q.shape[0], ROWS_PER_PASS)
        y = torch.cat([F.linear(rows, q[b : b + ROWS_PER_PASS].to(COMPUTE_DTYPE)) for b in blocks], dim=-1)
        y = y * scale
    return y.view(*x.shape[:-1], q.shape[0])


class Int8Linear(nn.Module):
    """A quantized ``nn.Linear``: int8 weight (N, K), bf16 per-row scale and bias; bf16 in and out."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, scale = quantize_rows(linear.weight)
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        bias = None if linear.bias is None else linear.bias.detach().to(COMPUTE_DTYPE)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _int8_mm(x, self.q, self.scale)
        return y if self.bias is None else y + self.bias


class Int8TiedEmbedding(nn.Module):
    """A quantized :class:`TiedEmbedding`: one int8 matrix serves the lookup (rows times their scales)
    and the output head (an int8 product)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """From :func:`quantize_rows`' output for the embedding's weight: int8 (V, C) and bf16 (V,)."""
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].to(COMPUTE_DTYPE) * self.scale[ids, None]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, (..., n_embd) -> (..., vocab_size)."""
        return _int8_mm(x, self.q, self.scale)


def quantize_child(
    parent: nn.Module,
    name: str,
    *,
    include_head: bool = True,
    linear: Callable[[nn.Linear], nn.Module] = Int8Linear,
    head: Callable[[torch.Tensor], nn.Module] | None = None,
) -> bool:
    """Replace ``parent``'s child ``name`` by its quantized form if it is a linear layer (or, with
    ``include_head``, the tied embedding/head). Returns whether it did; the original child is dropped.
    ``linear`` and ``head`` build the quantized layers (default int8; ``model.int4`` passes its own)."""
    child = getattr(parent, name)
    if isinstance(child, nn.Linear):
        setattr(parent, name, linear(child))
    elif include_head and isinstance(child, TiedEmbedding):
        setattr(parent, name, (head or _int8_head)(child.weight))
    else:
        return False
    return True


def _int8_head(weight: torch.Tensor) -> Int8TiedEmbedding:
    return Int8TiedEmbedding(*quantize_rows(weight))


def quantize_int8(model: nn.Module, *, include_head: bool = True) -> nn.Module:
    """Quantize a GPT's linear layers (and, with ``include_head``, its tied embedding/head) to int8 in place.

    Everything else (LayerNorms, position embeddings, the head when not included) moves to bf16, the
    activation dtype. Returns the model, in eval mode; it is for inference only.
    """
    return quantize_model(model, lambda parent, name: quantize_child(parent, name, include_head=include_head))


def quantize_model(model: nn.Module, quantize: Callable[[nn.Module, str], bool]) -> nn.Module:
    """Apply ``quantize(parent, name)`` to every child of every module (quantized from the weights' own
    precision, before any cast), then move the rest to bf16. Returns the model, in eval mode."""
    for module in list(model.modules()):
        for name, _ in list(module.named_children()):
            quantize(module, name)
    model.to(COMPUTE_DTYPE)  # floating-point tensors only: the int8 and int4 codes stay integers
    return model.eval()
