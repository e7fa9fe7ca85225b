"""The compiled decode step: one graph per engine shape, compiled ahead of time and kept on disk.

On the CPU the step is exported (``torch.export``; how many cache positions it reads, its span, is the one
dynamic size, see :func:`compiled_spans`) and compiled by AOTInductor (``aoti_compile_and_package``)
with ``freezing`` (the weights become constants, prepacked for the GEMM kernels; inductor freezes only with
grad off, so the compile runs under ``no_grad``) and ``max_autotune`` (inductor's C++ GEMM template or
oneDNN's inner product on the prepacked weights, whichever measures faster here). The package's shared
library, which holds the kernels and the weights, is kept in the user's cache (``$GPTGEN_CACHE_DIR``, else
``$XDG_CACHE_HOME/gptgen``, default ``~/.cache/gptgen``, under ``steps/``) and a later process maps it
directly: its name is a digest of everything the compiled code depends on (the weights' bytes, the config,
the dtype, the shapes, the source of ``model/`` and of this module, the torch version, the thread count and
the CPU: model name, the instruction set torch dispatches to, native bf16). A library holds the weights
once, prepacked, and the token embedding a second time (it is also the output head): about 650 MB for
GPT-2 124M in fp32. After each compile the least recently used libraries are deleted until the folder
holds at most ``$GPTGEN_CACHE_MAX_GB`` (default 8) GiB, and the work folders of compiles killed more than a
day ago go too.

Measured on GPT-2 124M geometry (2 cores, AMD EPYC Zen 4; the README has the benchmark): compiling with grad
on, which skipped freezing, gave steps of 42 ms in fp32 and 36 ms in bf16 at batch 8, against 32 and 19 ms
frozen (the same batch-1 steps: about 17 ms fp32, 9-10 ms bf16). Inductor's just-in-time ``torch.compile``
ran a batch-1 step in 19 ms against AOTInductor's 13-17 ms. On CUDA the step is ``torch.compile``'s
``reduce-overhead`` (a CUDA graph), compiled in each process, over every position.

The span as a dynamic size (GPT-2 124M fp32, 8 slots, this Zen 4): 20.3 ms a step at 64 positions, 21.3 at
96, 42.1 at 1,024, against 21.4 and 40.5 for steps compiled for 96 and 1,024 alone (at 96, the same bits).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import threading
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import model as model_package
from generate.kernels import bf16_native
from model import GPT, KVCache

log = logging.getLogger("gptgen")

# A compiled step: (slots, 1) token ids and positions, and how many cache positions to read -> (slots, V).
Step = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]

# Inductor's settings on the CPU; the last two keep autotuning's tables off stderr (we log progress).
CPU_OPTIONS = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}


# A compile's peak memory, measured as the compiling process's peak RSS (bench/bench.py, Zen 4): GPT-2 124M
# fp32 7,172 MiB (weights 475 MiB), bf16 3,089 MiB (237), the shipped 19M model in fp32 1,477 MiB (74): about
# 430 MiB plus 14x the weights in fp32 and 11x in bf16. Checked before compiling, with some margin.
COMPILE_FIXED_BYTES = 512 * 2**20
COMPILE_BYTES_PER_WEIGHT_BYTE = 15


def check_compile_memory(model: GPT) -> None:
    """Refuse to compile where the compile would run out of memory (see ``COMPILE_BYTES_PER_WEIGHT_BYTE``).

    Raises:
        MemoryError: naming what the compile needs, what is available and what to do instead.
    """
    from generate.engine import available_memory

    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    needed = COMPILE_FIXED_BYTES + COMPILE_BYTES_PER_WEIGHT_BYTE * weights
    free = available_memory(model.device)
    if free is not None and needed > free:
        raise MemoryError(
            f"compiling the decode step needs about {needed / 2**30:.1f} GiB (measured: about "
            f"{COMPILE_BYTES_PER_WEIGHT_BYTE}x the weights' {weights / 2**20:,.0f} MiB) but only "
            f"{free / 2**30:.1f} GiB are available; generate without compiling (compile=False, no --compile) "
            "or in a smaller dtype (bfloat16, int8, int4)"
        )


def cache_dir() -> Path:
    """Where compiled artifacts are kept: ``$GPTGEN_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/gptgen``
    (default ``~/.cache/gptgen``)."""
    if os.environ.get("GPTGEN_CACHE_DIR"):
        return Path(os.environ["GPTGEN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptgen"


def cpu_signature() -> dict[str, object]:
    """What compiled CPU code depends on: the CPU model, the instruction sets torch dispatches to, threads."""
    name = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    return {
        "cpu": name,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "bf16": bf16_native(),
        "threads": torch.get_num_threads(),
    }


def weights_digest(model: GPT) -> str:
    """A digest of the model's weights (every tensor's name, dtype, shape and bytes)."""
    h = hashlib.blake2b(digest_size=20)
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def code_digest() -> str:
    """A digest of the code a compiled step is traced from: ``model/`` and this module."""
    h = hashlib.blake2b(digest_size=16)
    for path in [*sorted(Path(model_package.__file__).parent.glob("*.py")), Path(__file__)]:
        h.update(path.read_bytes())
    return h.hexdigest()


def step_key(model: GPT, cache: KVCache) -> str:
    """The name of a compiled step: a digest of the weights, config, dtype, shapes, the code it is traced
    from, torch and the CPU."""
    facts = {
        "code": code_digest(),
        "torch": torch.__version__,
        "weights": weights_digest(model),
        "config": repr(model.config),
        "dtype": str(cache.k[0].dtype),
        "slots": cache.slots,
        "max_len": cache.max_len,
        "spans": compiled_spans(cache),
        **cpu_signature(),
    }
    return hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=16).hexdigest()


def compiled_spans(cache: KVCache) -> tuple[int, ...]:
    """The spans a packaged CPU step over ``cache`` can read: :func:`generate.runner.decode_spans` of its
    length (the span is a dynamic size of the exported step; the other shapes are static)."""
    from generate.runner import decode_spans

    return decode_spans(cache.max_len)


class _Step(torch.nn.Module):
    """The decode step as a module to export: the cache's buffers are inputs, written in place; ``span``'s
    length (a tensor of no elements) is how many cache positions attention reads."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, span: torch.Tensor, *kv: torch.Tensor
    ) -> torch.Tensor:
        cache = KVCache.over(kv[: len(kv) // 2], kv[len(kv) // 2 :])
        return self.model(tokens, positions=positions, cache=cache, span=span.shape[0], last_only=True)[:, -1]


@contextlib.contextmanager
def _progress(what: str, every: float = 15.0) -> Iterator[None]:
    """Log ``what`` now, then the time taken so far every ``every`` seconds until the block ends."""
    start, done = time.perf_counter(), threading.Event()

    def tick() -> None:
        while not done.wait(every):
            log.info("  ... still compiling (%.0f s)", time.perf_counter() - start)

    log.info("%s", what)
    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _inputs(cache: KVCache, device: torch.device) -> tuple[torch.Tensor, ...]:
    tokens = torch.zeros(cache.slots, 1, dtype=torch.long, device=device)
    return (tokens, torch.zeros_like(tokens), *cache.k, *cache.v)


def _span(span: int, device: torch.device) -> torch.Tensor:
    """The step's span input: a tensor of ``span`` x 0 elements (its length is all the step reads)."""
    return torch.empty(span, 0, device=device)


def _package(model: GPT, cache: KVCache, path: Path) -> None:
    """Export and AOT-compile the step; keep the package's shared library as ``path`` (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _use_inductor_cache()
    start = time.perf_counter()
    with _progress(f"compiling the decode step ({cache.slots} slots x {cache.max_len} positions; about a "
                   "minute for GPT-2 124M, once per shape)"):  # fmt: skip
        with torch.no_grad(), warnings.catch_warnings():
            # torch's own deprecation notices from inside export and inductor: nothing a user can act on
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            spans = compiled_spans(cache)
            tokens, positions, *kv = _inputs(cache, model.device)
            inputs = (tokens, positions, _span(spans[0], model.device), *kv)
            span = None  # a span input of one size: static, like the rest
            if len(spans) > 1:
                span = {0: torch.export.Dim("span", min=spans[0], max=spans[-1])}
            exported = torch.export.export(
                _Step(model), inputs, dynamic_shapes=(None, None, span, (None,) * len(kv))
            )
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".compiling-") as work:
            package = Path(work) / "step.pt2"
            # Under no_grad: inductor freezes (folds and prepacks the weights) only with grad off.
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=FutureWarning)
                warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
                torch._inductor.aoti_compile_and_package(exported, package_path=str(package),
                                                         inductor_configs=dict(CPU_OPTIONS))  # fmt: skip
            # The package is a zip holding one shared library (kernels and weights): keep that alone, so a
            # later process maps it directly instead of unpacking the zip (fp32 GPT-2 124M: 650 MB) again.
            with zipfile.ZipFile(package) as archive:
                libraries = [name for name in archive.namelist() if name.endswith(".so")]
                if len(libraries) != 1:
                    raise RuntimeError(
                        f"expected one shared library in the compiled package, found {libraries}"
                    )
                library = Path(work) / "step.so"
                with archive.open(libraries[0]) as source, open(library, "wb") as target:
                    shutil.copyfileobj(source, target, 16 * 2**20)
            os.replace(library, path)
    log.info("decode step compiled in %.1f s, kept in %s", time.perf_counter() - start, path)


def _use_inductor_cache() -> None:
    """Point inductor's own cache (autotuning's results, compiled kernels) into ours, if it can be made."""
    directory = cache_dir() / "inductor"
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(directory))


# The compiled libraries kept at most (GiB), unless $GPTGEN_CACHE_MAX_GB says otherwise; and how old a
# compile's work folder must be to count as left by a killed compile (a compile takes minutes).
DEFAULT_CACHE_MAX_GB = 8.0
STALE_WORK_SECONDS = 24 * 3600


def cache_limit_bytes() -> int:
    """The most bytes of compiled libraries kept: ``$GPTGEN_CACHE_MAX_GB`` GiB (default 8).

    Raises:
        ValueError: if the variable is set to something other than a number of GiB, 0 or more.
    """
    text = os.environ.get("GPTGEN_CACHE_MAX_GB", "").strip()
    try:
        gib = float(text) if text else DEFAULT_CACHE_MAX_GB
    except ValueError:
        gib = -1.0
    if not gib >= 0:  # (NaN too)
        raise ValueError(
            f"GPTGEN_CACHE_MAX_GB={text!r} is not a number of GiB; set it to 0 or more (default "
            f"{DEFAULT_CACHE_MAX_GB:g}) or unset it"
        )
    return int(min(gib, 2.0**40) * 2**30)


def prune(directory: Path, keep: Path, limit: int) -> list[Path]:
    """Delete the least recently used libraries in ``directory`` (by modification time, which each load
    renews) until they take at most ``limit`` bytes, never ``keep``; and compile work folders older than
    :data:`STALE_WORK_SECONDS`, and locks of compiles that never finished as old. A process that has a
    deleted library loaded keeps running (it stays mapped).
    Returns the libraries deleted."""
    libraries = []
    for path in directory.glob("*.so"):
        with contextlib.suppress(OSError):
            libraries.append((path.stat().st_mtime, path.stat().st_size, path))
    total, deleted = sum(size for _, size, _ in libraries), []
    for _, size, path in sorted(libraries):
        if total <= limit:
            break
        if path == keep:
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            record_path(path).unlink(missing_ok=True)
            lock_path(path).unlink(missing_ok=True)
            total -= size
            deleted.append(path)
            log.info(
                "removed %s (least recently used; compiled steps kept within %.1f GiB)", path, limit / 2**30
            )
    now = time.time()
    for work in directory.glob(".compiling-*"):
        with contextlib.suppress(OSError):
            if now - work.stat().st_mtime > STALE_WORK_SECONDS:
                shutil.rmtree(work)
    for lock in directory.glob("*.lock"):  # of compiles that never finished (a lock in use is renewed)
        with contextlib.suppress(OSError):
            if not lock.with_suffix(".so").exists() and now - lock.stat().st_mtime > STALE_WORK_SECONDS:
                lock.unlink()
    return deleted


def lock_path(path: Path) -> Path:
    """The lock a library's compile holds: ``<key>.lock``."""
    return path.with_suffix(".lock")


def record_path(path: Path) -> Path:
    """Where a library's size is recorded: ``<key>.record`` (not ``<key>.json``, a name AOTInductor's
    runner reads itself, as the spec of kernels it runs outside the library)."""
    return path.with_suffix(".record")


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it, so a reader sees the old file or the
    new one, never a part (the temporary is removed if the write fails)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _record(path: Path) -> None:
    """Note the library's size beside it, written after it: without it a library is damaged."""
    write_atomically(record_path(path), json.dumps({"size": path.stat().st_size, "torch": torch.__version__}))


def _intact(path: Path) -> bool:
    """Whether the library has its record and the size recorded there."""
    try:
        return json.loads(record_path(path).read_text())["size"] == path.stat().st_size
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _load(path: Path) -> Callable[..., torch.Tensor]:
    start = time.perf_counter()
    # What torch._inductor.aoti_load_package runs once it has unpacked a package: the library's runner.
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
    log.info("decode step loaded from %s in %.1f s", path, time.perf_counter() - start)

    def step(*inputs: torch.Tensor) -> torch.Tensor:
        return runner.run(list(inputs))[0]

    return step


def _try_load(path: Path, *, quiet: bool = False) -> Callable[..., torch.Tensor] | None:
    """The library at ``path`` loaded; None if there is none or it is damaged (logged unless ``quiet``)."""
    if not path.exists():
        return None
    try:
        if not _intact(path):  # a truncated library can load and then fault when it runs
            raise ValueError("its size differs from the one recorded when it was compiled")
        return _load(path)
    except Exception as e:  # a damaged or foreign file: compile it again (the new one replaces it)
        if not quiet:
            log.warning("could not load %s (%s); compiling it again", path, e)
        return None


@contextlib.contextmanager
def _compile_lock(path: Path) -> Iterator[bool]:
    """Hold ``<key>.lock`` (an exclusive ``flock``) while this step compiles, so two processes wanting the
    same step compile it once. Yields whether another process held it first (its library may now be there).
    Without a writable folder or ``fcntl``, no lock."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path(path), "a")  # noqa: SIM115 (closed below, after the lock is released)
    except (ImportError, OSError):
        yield False
        return
    with handle:
        waited = False
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is compiling this step; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
            waited = True
        with contextlib.suppress(OSError):
            os.utime(lock_path(path))  # in use: not a stale lock for prune()
        try:
            yield waited
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def packaged_step(model: GPT, cache: KVCache) -> tuple[Step, str]:
    """The CPU step: load its package from the cache directory, compiling it first if it is not there (once,
    when several processes want it at the same time: the others wait and load it). It reads any of
    :func:`compiled_spans` positions. Returns it and its key (:func:`step_key`)."""
    limit = cache_limit_bytes()  # (a bad setting refused before a compile, not after)
    key = step_key(model, cache)
    path = cache_dir() / "steps" / f"{key}.so"
    step = _try_load(path)
    if step is None:
        check_compile_memory(model)  # (before the lock: a refusal writes nothing)
        with _compile_lock(path) as waited:
            step = _try_load(path, quiet=True) if waited else None
            if step is None:
                step = _compile(model, cache, path, limit)
    with contextlib.suppress(OSError):
        os.utime(path)  # last used: what a clean-up of the cache directory would go by

    spans = {span: _span(span, model.device) for span in compiled_spans(cache)}

    def run(tokens: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        return step(tokens, positions, spans[span], *cache.k, *cache.v)

    return run, key


def _compile(model: GPT, cache: KVCache, path: Path, limit: int) -> Callable[..., torch.Tensor]:
    try:
        _package(model, cache, path)
    except OSError as e:  # the cache directory cannot be written: compile for this process alone
        log.warning(
            "could not keep the compiled step in %s (%s); compiling it for this process only (set "
            "GPTGEN_CACHE_DIR to a writable directory to keep it)", path.parent, e,
        )  # fmt: skip
        # Keep the library's file until this process exits (the loaded library is mapped from it).
        directory = Path(tempfile.mkdtemp(prefix="gptgen-step-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        _package(model, cache, directory / path.name)
        return _load(directory / path.name)
    _record(path)
    step = _load(path)
    prune(path.parent, path, limit)
    return step


def jit_step(model: GPT, cache: KVCache) -> Step:
    """The step compiled by ``torch.compile`` in this process (CUDA: ``reduce-overhead``), run once. It reads
    all ``cache.max_len`` positions, whatever span it is given (one graph)."""
    _use_inductor_cache()

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(tokens, positions=positions, cache=cache, last_only=True)[:, -1]

    cuda = model.device.type == "cuda"
    compiled = torch.compile(step, mode="reduce-overhead" if cuda else None, fullgraph=True, dynamic=False)
    # On the CPU the settings go in inductor's config around the first call, which compiles: passed as
    # torch.compile(options=...) they did not take (no frozen weights, no GEMM template: 50 ms a step).
    # Inputs made as the engine makes them (inference tensors, not one tensor twice): dynamo guards on them,
    # and a guard that fails at the first real step recompiles.
    what = f"compiling the decode step ({cache.slots} slots x {cache.max_len} positions)"
    with _progress(what), torch.inference_mode(), torch._inductor.config.patch({} if cuda else CPU_OPTIONS):
        compiled(*_inputs(cache, model.device)[:2])  # writes position 0 of every slot (cleared on join)

    def run(tokens: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        return compiled(tokens, positions)

    return run


def compile_step(model: GPT, cache: KVCache) -> tuple[Step, tuple[int, ...], str | None]:
    """The compiled decode step of ``model`` over ``cache``, ready to run; the spans it can read; and the
    key of its library on the CPU (:func:`step_key`), None elsewhere.

    It takes (slots, 1) token ids and positions and a span, and returns (slots, V) logits of the last
    position. On the CPU it is an AOTInductor package kept on disk (:func:`packaged_step`), whose span is a
    dynamic size: it reads any of :func:`compiled_spans` cache positions of every slot (all its other shapes
    are static, one graph). Elsewhere it is ``torch.compile``'s, over all ``cache.max_len`` positions.
    """
    if model.device.type == "cpu":
        step, key = packaged_step(model, cache)
        return step, compiled_spans(cache), key
    return jit_step(model, cache), (cache.max_len,), None
