"""The compiled steps' store on disk: where they are kept, loading, one compile at a time, a size limit."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

log = logging.getLogger("gptgen")

DEFAULT_CACHE_MAX_GB = 8.0


def cache_dir() -> Path:
    """Compiled steps' home: ``$GPTGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/gptgen`` (``~/.cache/gptgen``)."""
    if os.environ.get("GPTGEN_CACHE_DIR"):
        return Path(os.environ["GPTGEN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptgen"


def cache_limit_bytes() -> int:
    """The most bytes of compiled steps kept: ``$GPTGEN_CACHE_MAX_GB`` GiB (default 8), a number >= 0."""
    text = os.environ.get("GPTGEN_CACHE_MAX_GB", "").strip()
    try:
        gib = float(text) if text else DEFAULT_CACHE_MAX_GB
    except ValueError:
        gib = -1.0
    if not gib >= 0:  # (NaN too)
        raise ValueError(f"GPTGEN_CACHE_MAX_GB={text!r} is not a number of GiB; set it to 0 or more (default "
                         f"{DEFAULT_CACHE_MAX_GB:g}) or unset it")  # fmt: skip
    return int(min(gib, 2.0**40) * 2**30)


def prune(directory: Path, keep: Path, limit: int) -> list[Path]:
    """In ``directory``, delete killed compiles' working folders (``.compiling-<key>-*``, their key's lock
    free: a compile holds it), then the least recently used libraries (by modification time, which each load
    renews) until they take at most ``limit`` bytes, never ``keep``. Returns the libraries deleted."""
    with contextlib.suppress(ImportError):
        import fcntl

        for work in directory.glob(".compiling-*-*"):
            lock = directory / f"{work.name.removeprefix('.compiling-').rsplit('-', 1)[0]}.lock"
            with contextlib.suppress(OSError), open(lock) as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (OSError while its compile runs)
                shutil.rmtree(work)
    libraries = []
    for path in directory.glob("*.so"):
        with contextlib.suppress(OSError):
            libraries.append((path.stat().st_mtime, path.stat().st_size, path))
    total, deleted = sum(size for _, size, _ in libraries), []
    for _, size, path in sorted(libraries):
        if total > limit and path != keep:
            with contextlib.suppress(OSError):
                path.unlink()
                total -= size
                deleted.append(path)
                log.info("removed %s (compiled steps kept within %.1f GiB)", path, limit / 2**30)
    return deleted


def load(path: Path, weights: dict[str, torch.Tensor] | None = None) -> Callable[..., torch.Tensor] | None:
    """The library at ``path`` loaded (as ``aoti_load_package`` does once unpacked), given ``weights`` (by
    name) where it holds none, or None where there is none or it does not load (a damaged file is compiled
    again and replaced)."""
    if not path.exists():
        return None
    try:
        runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
        if weights is not None:  # (used where they are, not copied: user-managed)
            names = runner.get_constant_names_to_original_fqns()
            runner.update_constant_buffer({n: weights[fqn] for n, fqn in names.items()}, False, True, True)
    except Exception as e:
        log.warning("could not load %s (%s); compiling it again", path, e)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # last used: what prune() goes by
    release_constants_pages(path)
    return lambda *inputs: runner.run(list(inputs))[0]


def constants_span(path: Path) -> tuple[int, int]:
    """The addresses where the loaded library at ``path`` holds its weights (``.lrodata``): [start, end).
    OSError or ValueError where it is not loaded or has no such symbols."""
    library = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    start, end = (ctypes.c_char.in_dll(library, f"_binary_constants_bin_{edge}") for edge in ("start", "end"))
    return ctypes.addressof(start), ctypes.addressof(end)


def release_constants_pages(path: Path) -> int:
    """Drop the loaded library's pages of its weights, which its runner copied at load: read-only file pages
    (read again if touched) counting in this process's memory for nothing. Returns the bytes released."""
    try:
        start, end = constants_span(path)
        low, high = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
        libc = ctypes.CDLL(None)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return high - low if high > low and libc.madvise(low, high - low, mmap.MADV_DONTNEED) == 0 else 0
    except (OSError, ValueError, AttributeError):  # another platform or layout: nothing to release
        return 0


@contextlib.contextmanager
def compile_lock(path: Path) -> Iterator[None]:
    """Hold ``<key>.lock`` (an exclusive ``flock``; none without ``fcntl`` or a writable folder) while this
    step compiles, so two processes wanting the same step compile it once (the second loads the first's)."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 (closed below)
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
