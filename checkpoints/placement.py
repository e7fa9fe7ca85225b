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


# The device types the model, the KV cache and the memory check are written for.
SUPPORTED_DEVICES = ("cpu", "cuda", "mps")
DEVICE_FIX = "use 'cpu', or 'cuda' / 'cuda:N' on a machine with a CUDA GPU, or 'mps' on Apple silicon"


def _first_line(error: BaseException) -> str:
    """A backend's error message cut to its first line (some run to dozens of lines)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _computes(dev: torch.device, dtype: torch.dtype) -> str | None:
    """None if ``dev`` runs what every forward step runs in ``dtype``, else the backend's first error line."""
    try:  # a matmul, layer norm and softmax in the requested precision
        x = torch.ones(2, 4, dtype=dtype, device=dev)
        torch.softmax(torch.nn.functional.layer_norm(x @ x.T, (2,)), dim=-1).sum().item()
    except (RuntimeError, NotImplementedError, AssertionError) as e:
        return _first_line(e)
    return None


def resolve_device(device: torch.device | str | None, dtype: torch.dtype = torch.float32) -> torch.device:
    """Check that ``device`` (default CPU) exists here and can run the model's operations in ``dtype``.

    Every refusal is a one-line message naming the device and what to use instead.

    Raises:
        ValueError: for an unknown device string, a device type this toolkit does not run on (``meta``,
            ``xpu``, ``vulkan``...), a device this machine lacks, or a dtype it cannot compute in.
    """
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {device!r}; {DEVICE_FIX}") from None
    name = str(dev)
    if dev.type not in SUPPORTED_DEVICES:
        raise ValueError(
            f"device {name!r} is not supported (the model runs on cpu, cuda or mps); {DEVICE_FIX}"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} is not available: this torch build or machine has no CUDA; use 'cpu'"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"device {name!r} is not available: this machine has {count} CUDA device(s), "
                f"cuda:0 to cuda:{count - 1}; use one of those or 'cpu'"
            )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r} is not available on this machine; use 'cpu'")
    problem = _computes(dev, dtype)
    if problem is None:
        return dev
    if dtype != torch.float32 and _computes(dev, torch.float32) is None:
        raise ValueError(f"device {name!r} cannot compute in {dtype} ({problem}); use float32 or bfloat16")
    fix = "reinstall torch, whose CPU build runs it" if dev.type == "cpu" else "use 'cpu'"
    raise ValueError(f"device {name!r} cannot run the model ({problem}); {fix}")
