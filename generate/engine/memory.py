"""How much memory an allocation can still get: the up-front checks before an engine or a compile."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from model import GPTConfig, KVCache
from model.attention import CHUNK

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


# Bytes per vocabulary entry of each row that a step holds at its peak: fp32 logits, penalty counts and flags,
# and sampling's temporaries (softmax, a float64 cumulative sum, masks; top-k's sort). Measured on the
# first engine: a 512-row batch with top-p, a repetition penalty and logprobs raised peak RSS by 41 bytes.
VOCAB_BYTES_PER_ROW = 48


def request_bytes(config: GPTConfig, slots: int, cache_len: int, prompt_len: int, dtype: torch.dtype) -> int:
    """Memory an engine needs beyond the weights: the KV cache, per-row vocabulary-sized state (logits,
    penalty counts) and one prefill's activations (attention scores included)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    positions = -(-cache_len // CHUNK) * CHUNK + 1  # (what KVCache allocates: whole chunks, one more)
    cache = KVCache.bytes_per_token(config, dtype) * slots * positions
    per_row_vocab = slots * config.vocab_size * VOCAB_BYTES_PER_ROW
    # (the cached attention holds three fp32 (n_head, T, T) tensors at its peak: scores, masked, softmax)
    prefill = prompt_len * (4 * config.inner_dim * itemsize + 3 * config.n_head * prompt_len * 4)
    return cache + per_row_vocab + prefill


def check_engine_memory(
    config: GPTConfig, slots: int, cache_len: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Refuse (MemoryError naming the figures and what to make smaller) an engine that would not fit."""
    needed, free = request_bytes(config, slots, cache_len, cache_len, dtype), available_memory(device)
    if free is not None and needed > free:
        raise MemoryError(
            f"this engine needs about {needed / 2**20:,.0f} MiB ({slots} slots x {cache_len} positions of KV "
            f"cache, {KVCache.bytes_per_token(config, dtype):,} bytes each, plus working memory) but "
            f"only {free / 2**20:,.0f} MiB are available on {device}; use fewer slots (prompts run at once) "
            "or fewer new tokens"
        )
