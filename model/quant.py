"""Int8 weight-only quantization: int8 matrices with one bf16 scale per output row, bf16 activations. Under
:data:`DEQUANT_ROWS` input rows a product runs in ``aten._weight_int8pack_mm``; from there (a prompt, where it
is slower) blocks of :data:`ROWS_PER_PASS` weight rows turn into bf16 (exactly) for a bf16 product, scaled
after (one rounding more). The way is chosen by shape, so a product's bits follow from shapes."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.gpt import TiedEmbedding

COMPUTE_DTYPE = torch.bfloat16
ROWS_PER_PASS = 4096  # quantized (or made bf16 for a product) per pass: bounds the temporary (K=768: 12 MiB)
DEQUANT_ROWS = 16  # input rows from which a product runs in bf16 (about where the two ways cost the same)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8, ``weight ~= q * scale[:, None]``: ``(q, scale)``, int8 (N, K) in [-127, 127]
    and bf16 (N,)."""
    w = weight.detach().float()
    low, high = w.aminmax(dim=1)  # the largest magnitude per row, without an abs() copy of the matrix
    scale = (torch.maximum(-low, high) / 127.0).clamp(min=1e-12)
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    for start in range(0, w.shape[0], ROWS_PER_PASS):
        rows = slice(start, start + ROWS_PER_PASS)
        q[rows] = (w[rows] / scale[rows, None]).round_().clamp_(-127, 127)
    return q, scale.to(COMPUTE_DTYPE)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, K) in the compute dtype, the kernels' input (a ``.to`` that changes nothing costs)."""
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
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(COMPUTE_DTYPE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _int8_mm(x, self.q, self.scale)
        return y if self.bias is None else y + self.bias


class Int8TiedEmbedding(nn.Module):
    """A quantized :class:`TiedEmbedding` from :func:`quantize_rows`' output, for lookup and output head."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].to(COMPUTE_DTYPE) * self.scale[ids, None]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, (..., n_embd) -> (..., vocab_size)."""
        return _int8_mm(x, self.q, self.scale)


def quantize_child(parent: nn.Module, name: str, *, include_head: bool = True,
                   linear: Callable[[nn.Linear], nn.Module] = Int8Linear,
                   head: Callable[[torch.Tensor], nn.Module] = lambda w: Int8TiedEmbedding(*quantize_rows(w)),
                   ) -> bool:  # fmt: skip
    """Replace ``parent``'s child ``name`` by ``linear(child)`` if it is a linear layer, or (with
    ``include_head``) by ``head(weight)`` if it is the tied embedding; return whether it did."""
    child = getattr(parent, name)
    if isinstance(child, nn.Linear):
        setattr(parent, name, linear(child))
    elif include_head and isinstance(child, TiedEmbedding):
        setattr(parent, name, head(child.weight))
    else:
        return False
    return True


def quantize_int8(model: nn.Module, *, include_head: bool = True) -> nn.Module:
    """Quantize a GPT's linear layers (and with ``include_head`` its tied head) to int8 in place."""
    return quantize_model(model, quantize_child, include_head=include_head)


def quantize_model(model: nn.Module, quantize: Callable[..., bool], **options: object) -> nn.Module:
    """Apply ``quantize(parent, name, **options)`` to every module's children, then cast the rest to bf16."""
    for module in list(model.modules()):
        for name, _ in list(module.named_children()):
            quantize(module, name, **options)
    model.to(COMPUTE_DTYPE)  # floating-point tensors only: the int8 and int4 codes stay integers
    return model.eval()
