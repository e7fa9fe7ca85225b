"""How much memory an allocation can still get: the up-front checks before an engine or a compile."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

CGROUP_DIR = Path("/sys/fs/cgroup")  # cgroup v2's files (v1 keeps its memory files under memory/)


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``, or None if unknown.

    On the CPU, the least of Linux's MemAvailable, the room under this process's address-space limit
    (``ulimit -v``, against its current size) and the room under its container's memory limit (cgroup v2
    ``memory.max``, or v1 ``memory.limit_in_bytes``, against current usage): a limit below the machine's
    free memory is what an allocation runs into first.
    """
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    rooms = [_meminfo_available(), _address_space_room(), _cgroup_room()]
    known = [r for r in rooms if r is not None]
    return max(0, min(known)) if known else None


def out_of_memory(error: BaseException, advice: str) -> MemoryError | None:
    """torch's allocator failure as a MemoryError that says what it means and what to do; None otherwise.

    The CPU allocator raises a RuntimeError such as ``[enforce fail at alloc_cpu.cpp:127] data.
    DefaultCPUAllocator: not enough memory: you tried to allocate 123 bytes``; CUDA raises
    ``torch.OutOfMemoryError``. ``advice`` ends the message: what the caller can change.
    """
    text = str(error)
    cpu = isinstance(error, RuntimeError) and ("DefaultCPUAllocator" in text or "alloc_cpu" in text)
    if not (cpu or isinstance(error, torch.OutOfMemoryError)):
        return None
    size = re.search(r"(?:allocate|Tried to allocate) ([\d.]+) (bytes|[KMG]iB)", text)
    tried = ""
    if size:
        scale = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[size.group(2)]
        tried = f" (an allocation of {float(size.group(1)) * scale / 2**20:,.0f} MiB failed)"
    return MemoryError(f"out of memory{tried}; {advice}")


@contextmanager
def said_plainly(advice: str) -> Iterator[None]:
    """Turn the allocator's failures in the block into :func:`out_of_memory`'s MemoryError."""
    try:
        yield
    except RuntimeError as e:
        oom = out_of_memory(e, advice)
        if oom is None:
            raise
        raise oom from e


def _read_number(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _address_space_room() -> int | None:
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status", encoding="ascii") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        return limit - size
    except (ImportError, OSError, ValueError, StopIteration):
        return None


def _cgroup_room() -> int | None:
    v1 = ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")
    for limit_file, usage_file in (("memory.max", "memory.current"), v1):
        limit = _read_number(CGROUP_DIR / limit_file)
        if limit is not None and limit < 2**60:  # v1 writes "no limit" as a huge number
            usage = _read_number(CGROUP_DIR / usage_file) or 0
            return limit - usage
    return None
