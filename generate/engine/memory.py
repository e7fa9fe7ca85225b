"""How much memory an allocation can still get: the up-front checks before an engine or a compile."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from model import GPTConfig, KVCache

CGROUP_DIR = Path("/sys/fs/cgroup")  # cgroup v2's files (v1 keeps its memory files under memory/)


def available_memory(device: torch.device) -> int | None:
    """Bytes ``device`` can still allocate (None if unknown). CPU: the least of MemAvailable and the rooms
    under this process's ``ulimit -v`` and its container's limit (cgroup v2 or v1); each may bind first."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    rooms = [_proc_bytes("/proc/meminfo", "MemAvailable:"), _cgroup_room()]
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY:
            size = _proc_bytes("/proc/self/status", "VmSize:")
            rooms.append(None if size is None else limit - size)
    known = [r for r in rooms if r is not None]
    return max(0, min(known)) if known else None


def out_of_memory(error: BaseException, advice: str) -> MemoryError | None:
    """torch's allocator failure (the CPU's RuntimeError, CUDA's ``torch.OutOfMemoryError``) as a MemoryError
    that says so, the failed allocation's size and then ``advice``, what the caller can change; else None."""
    text = str(error)
    cpu = isinstance(error, RuntimeError) and ("DefaultCPUAllocator" in text or "alloc_cpu" in text)
    if not (cpu or isinstance(error, torch.OutOfMemoryError)):
        return None
    tried = ""
    if size := re.search(r"(?:allocate|Tried to allocate) ([\d.]+) (bytes|[KMG]iB)", text):
        scale = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[size.group(2)]
        tried = f" (an allocation of {float(size.group(1)) * scale / 2**20:,.0f} MiB failed)"
    return MemoryError(f"out of memory{tried}; {advice}")


@contextlib.contextmanager
def said_plainly(advice: str) -> Iterator[None]:
    """Turn the allocator's failures in the block into :func:`out_of_memory`'s MemoryError."""
    try:
        yield
    except RuntimeError as e:
        if (oom := out_of_memory(e, advice)) is None:
            raise
        raise oom from e


def _proc_bytes(path: str, key: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _read_number(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _cgroup_room() -> int | None:
    v1 = ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")
    for limit_file, usage_file in (("memory.max", "memory.current"), v1):
        limit = _read_number(CGROUP_DIR / limit_file)
        if limit is not None and limit < 2**60:  # v1 writes "no limit" as a huge number
            return limit - (_read_number(CGROUP_DIR / usage_file) or 0)
    return None


VOCAB_BYTES_PER_ROW = 48  # peak bytes of a step's row per vocab id (logits, penalties, sampling; 41 measured)


def check_engine_memory(
    config: GPTConfig, slots: int, cache_len: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Refuse (MemoryError naming the figures and what to make smaller) an engine that would not fit: beyond
    the weights it needs the KV cache, per-row vocabulary-sized state and one prefill's activations."""
    cache = slots * KVCache(config, 1, cache_len, dtype=dtype, device="meta").nbytes  # (on meta: no memory)
    # (a prefill's cached attention holds three fp32 (n_head, T, T) tensors at its peak)
    prefill = cache_len * (4 * config.inner_dim * dtype.itemsize + 3 * config.n_head * cache_len * 4)
    needed = cache + slots * config.vocab_size * VOCAB_BYTES_PER_ROW + prefill
    if (free := available_memory(device)) is not None and needed > free:
        raise MemoryError(f"this engine needs about {needed / 2**20:,.0f} MiB ({slots} slots x {cache_len} "
                          f"positions of KV cache, {KVCache.bytes_per_token(config, dtype):,} bytes each, "
                          f"plus working memory) but only {free / 2**20:,.0f} MiB are available on "
                          f"{device}; use fewer slots (prompts run at once) or fewer new tokens")  # fmt: skip
