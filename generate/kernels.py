"""Eager kernel routes, chosen on the machine that runs them; ``model/`` itself only calls ``F.linear``.

One route so far: fp32 products of the eager decode step on the CPU can run in oneDNN's inner product
(``torch.ops.mkldnn._linear_pointwise``, the kernel ``torch.compile`` uses for CPU linears) instead of
``F.linear`` (MKL). On a 2-core AMD EPYC Zen 4, one row (batch 1), GPT-2 124M's products took: head
(50257 x 768) MKL 12.0 ms, oneDNN 6.1 ms; 3072 x 768 0.18 vs 0.09 ms; 768 x 768 about equal. Whether it pays
depends on the CPU and the row count, so :func:`onednn_pays` measures it for the model at hand when an
eager engine is made. Like MKL's, oneDNN's sums for a row depend on how many rows the product has, not on
the other rows' values, so rows stay bitwise independent within an engine either way.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from model import GPT


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


class OneDNNLinear(TorchFunctionMode):
    """Within this mode, fp32 CPU ``F.linear`` calls run in oneDNN's inner product; others are unchanged."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            if x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and weight.dim() == 2:
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                return _onednn_linear(x, weight, bias)
        return func(*args, **kwargs)


def _best_of(fn: Any, *args: torch.Tensor, repeat: int = 3) -> float:
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
