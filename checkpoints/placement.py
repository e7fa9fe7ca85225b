"""Where and in what precision a model runs: dtype names and device checks, done before any weight is read."""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """Turn ``None`` (float32), a dtype name (``"bfloat16"``, ``"bf16"``...) or a torch dtype into a dtype.

    Raises:
        ValueError: for a dtype the model cannot run in.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")


def resolve_device(device: torch.device | str | None, dtype: torch.dtype = torch.float32) -> torch.device:
    """Check that ``device`` (default CPU) exists here and can run the model's operations in ``dtype``.

    Raises:
        ValueError: for an unknown device string, a device this machine lacks, or a dtype it cannot compute.
    """
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {str(dev)!r} is not available: this torch build or machine has no CUDA; use 'cpu'"
        )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(dev)!r} is not available on this machine; use 'cpu'")
    try:  # a matmul, layer norm and softmax in the requested precision: what every forward step runs
        x = torch.ones(2, 4, dtype=dtype, device=dev)
        torch.softmax(torch.nn.functional.layer_norm(x @ x.T, (2,)), dim=-1).sum().item()
    except RuntimeError as e:
        raise ValueError(
            f"device {str(dev)!r} cannot compute in {dtype} ({e}); use float32 or bfloat16"
        ) from e
    return dev
