"""The compiled decode step (docs/engine.md). On the CPU an AOTInductor library, exported over a KV cache of
the whole window with the number of chunks it reads as a dynamic size (and the width, where one library serves
several), kept on disk under a digest of all it depends on (:func:`step_key`); on CUDA ``torch.compile``'s
``reduce-overhead``, in each process."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
import time
import types
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch

import model as model_package
from generate.engine import memory, runner, store
from model import GPT, KVCache
from model.attention import CHUNK

log = logging.getLogger("gptgen")
CODES: dict[tuple, types.CodeType] = {}  # (see jit_step)

# A compiled step: (slots, width) token ids and positions, and how many cache positions to read (rounded up
# to whole chunks) -> (slots, width, V) logits (a width of 1: a decode step; more: a speculative one).
Step = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
Progress = runner.Progress

# Inductor on the CPU: weights frozen and prepacked for one kernel per product, so nothing is timed: its C++
# GEMM template with AVX-512 for a step of at most TEMPLATE_ROWS rows (slots x width), else ATen's. A row's
# bits from the template do not depend on how many there are: a lone slot's widths share one library.
AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
TEMPLATE_ROWS = 4
CPU_OPTIONS = {"freezing": True, "max_autotune": True, "aot_inductor.precompile_headers": False}
# But a step of one row of an unquantized model runs each product as inductor's reduction over the weights'
# plain rows (its decompose_mm_pass; as fast), nothing frozen: the library holds no weights, and is given the
# model's own at load (user-managed constants), so a process holds them once.
DECOMPOSE = {"skip_dynamic_shape_dim_check": True, "cpu_max_other_dimension_decomposition": 2**31}
OWN_OPTIONS = {"aot_inductor.precompile_headers": False, "aot_inductor.package_constants_in_so": False,
               "post_grad_fusion_options": {"decompose_mm_pass": DECOMPOSE}}  # fmt: skip
_COMPILING = threading.Lock()  # one compile at a time: inductor's cache directory is the process's

# A compile's peak memory is about 430 MiB plus 14x the weights in fp32 (11x in bf16): checked with a margin.
COMPILE_FIXED_BYTES = 512 * 2**20
COMPILE_BYTES_PER_WEIGHT_BYTE = 15


def check_compile_memory(model: GPT) -> None:
    """Refuse to compile (MemoryError naming the figures and what to do) where it would run out of memory."""
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    needed = COMPILE_FIXED_BYTES + COMPILE_BYTES_PER_WEIGHT_BYTE * weights
    if (free := memory.available_memory(model.device)) is not None and needed > free:
        raise MemoryError(f"compiling the decode step needs about {needed / 2**30:.1f} GiB (about "
                          f"{COMPILE_BYTES_PER_WEIGHT_BYTE}x the weights' {weights / 2**20:,.0f} MiB) but "
                          f"only {free / 2**30:.1f} GiB are available; generate without compiling (compile="
                          "False, no --compile) or in a smaller dtype (bfloat16, int8, int4)")  # fmt: skip


def step_key(model: GPT, cache: KVCache, widths: tuple[int, ...] = (1,)) -> str:
    """The name of a compiled step: a digest of everything its library depends on (the weights' values only
    where it holds them: a library given the model's own serves every checkpoint of the same shapes)."""
    h, values = hashlib.blake2b(digest_size=16), own_weights(model, cache, widths) is None
    for path in [*sorted(Path(model_package.__file__).parent.glob("*.py")), runner.__file__, __file__]:
        h.update(Path(path).read_bytes())
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:{t.stride()};".encode())  # (a layout is compiled in)
        t = t.detach().cpu().contiguous()
        h.update(t.reshape(-1).view(torch.uint8).numpy().data if values and t.numel() else b"")
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    facts = [repr(model.config), str(cache.k[0].dtype), cache.slots, cache.max_len, torch.__version__, cpu,
             torch.backends.cpu.get_cpu_capability(), torch.get_num_threads(), widths]  # fmt: skip
    h.update(json.dumps(facts).encode())
    return h.hexdigest()


def own_weights(model: GPT, cache: KVCache, widths: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
    """The model's tensors by the names the step's library has for them where it is given them (one row, no
    quantized weights, all laid out plainly: ``checkpoints.load(..., plain=True)``; :data:`OWN_OPTIONS`),
    else None."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    if cache.slots * widths[-1] > 1 or any(t.dtype in (torch.int8, torch.uint8) or not t.is_contiguous()
                                           for _, t in named):  # fmt: skip
        return None
    return {f"model.{name}": t for name, t in named}


class _Step(torch.nn.Module):
    """The step to export. Inputs: the tokens (for their shape), their positions, ``chunks`` (no elements: its
    length counts the chunks of cache positions attention reads), ``x`` (the tokens' :meth:`model.GPT.embed`,
    so the library keeps no plain copy of the embedding table), the cache's buffers (written in place)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, chunks, x, *kv) -> torch.Tensor:
        cache = KVCache.over(kv[: len(kv) // 2], kv[len(kv) // 2 :])
        return runner.forward_step(self.model, cache, tokens, positions, chunks.shape[0] * CHUNK, x)


@contextlib.contextmanager
def _progress(what: str, progress: Progress, every: float = 15.0) -> Iterator[None]:
    """Say ``what`` now (to the log and ``progress``), then the time taken every ``every`` seconds."""
    start, done = time.perf_counter(), threading.Event()

    def say(line: str) -> None:
        log.info("%s", line)
        if progress is not None:
            progress(line)

    def tick() -> None:
        while not done.wait(every):
            say(f"  ... still compiling ({time.perf_counter() - start:.0f} s)")

    say(what)
    (thread := threading.Thread(target=tick, daemon=True)).start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    say(f"decode step compiled in {time.perf_counter() - start:.1f} s")


def _package(model: GPT, cache: KVCache, path: Path, progress: Progress, widths: tuple[int, ...]) -> None:
    """Export and AOT-compile the step for ``widths`` (all between the first and the last); keep the package's
    shared library as ``path`` (atomically)."""
    from torch._inductor.utils import fresh_cache  # (imported here: eager processes import no inductor)

    path.parent.mkdir(parents=True, exist_ok=True)
    low, width = widths[0], widths[-1]
    label = f"{low}-{width}" if low < width else f"{width}"
    rows = f"{cache.slots} row{'s' * (cache.slots != 1)}" + (f" x {label} tokens" if width > 1 else "")
    what = (f"compiling the decode step ({rows} x {cache.max_len} positions; half a minute or more, once per "
            "checkpoint, dtype and width)")  # fmt: skip
    with (
        _COMPILING,  # (first: a compile waiting for another does not say it is compiling)
        _progress(what, progress),
        torch.no_grad(),  # inductor freezes (folds and prepacks the weights) only with grad off
        warnings.catch_warnings(),
        tempfile.TemporaryDirectory(dir=path.parent, prefix=f".compiling-{path.stem}-") as work,
        fresh_cache(dir=work),  # inductor's files, deleted after (headers off: it would keep them in /tmp)
        contextlib.ExitStack() as stack,
    ):
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own notices, not the user's
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        most = cache.k[0].shape[2] // CHUNK  # (the cache holds whole chunks)
        # (a dynamic size's example is not 1, which export would take for a constant)
        example = max(low, 2) if low < width else width
        tokens = torch.zeros(cache.slots, example, dtype=torch.long, device=model.device)
        count = torch.empty(min(2, most), 0, device=model.device)  # the chunk count: a size, no elements
        embedded = model.embed(tokens, torch.zeros_like(tokens))
        inputs = (tokens, torch.zeros_like(tokens), count, embedded, *cache.k, *cache.v)
        chunks = {0: torch.export.Dim("chunks", min=1, max=most)} if most > 1 else None
        wide = {1: torch.export.Dim("width", min=low, max=width)} if low < width else None
        dynamic = (wide, wide, chunks, wide, (None,) * (2 * len(cache.k)))
        exported = torch.export.export(_Step(model), inputs, dynamic_shapes=dynamic)
        package = Path(work) / "step.pt2"
        gemm = "CPP" if AVX512 and cache.slots * width <= TEMPLATE_ROWS else "ATEN"
        options = {**CPU_OPTIONS, "max_autotune_gemm_backends": gemm}
        if own_weights(model, cache, widths) is not None:  # (the pass reads its size limits once, at import)
            from torch._inductor.fx_passes import decompose_mem_bound_mm as limits

            stack.enter_context(mock.patch.object(limits, "cpu_max_other_dimension_decomposition", 2**31))
            options = OWN_OPTIONS
        torch._inductor.aoti_compile_and_package(exported, package_path=str(package),
                                                 inductor_configs=options)  # fmt: skip
        # Keep the package's one shared library alone: a later process loads it without unpacking a zip.
        with zipfile.ZipFile(package) as archive:
            libraries = [name for name in archive.namelist() if name.endswith(".so")]
            if len(libraries) != 1:
                raise RuntimeError(f"expected one shared library in the compiled package, found {libraries}")
            library = archive.extract(libraries[0], work)
        os.replace(library, path)


def packaged_step(model: GPT, cache: KVCache, progress: Progress = None,
                  widths: tuple[int, ...] = (1,)) -> Step:  # fmt: skip
    """The CPU step for ``widths`` (every width from the first to the last): loaded from the cache directory,
    compiled first if it is not there."""
    limit = store.cache_limit_bytes()  # (a bad setting refused before a compile, not after)
    path = store.cache_dir() / "steps" / f"{step_key(model, cache, widths)}.so"
    step = store.load(path, own := own_weights(model, cache, widths))
    if step is None:
        check_compile_memory(model)  # (before the lock: a refusal writes nothing)
        try:
            with store.compile_lock(path):
                step = store.load(path, own)  # another process may have compiled it meanwhile
                if step is None:
                    _package(model, cache, path, progress, widths)
                    step = store.load(path, own)
                    store.prune(path.parent, path, limit)
        except OSError as e:  # the cache directory cannot be written: compile for this process alone
            advice = "set GPTGEN_CACHE_DIR to a writable directory to keep it"
            log.warning("could not keep the compiled step in %s (%s); compiling it for this process only "
                        "(%s)", path.parent, e, advice)  # fmt: skip
            # (the loaded library stays mapped once its directory is gone)
            with tempfile.TemporaryDirectory(prefix="gptgen-step-", ignore_cleanup_errors=True) as directory:
                _package(model, cache, Path(directory) / path.name, progress, widths)
                step = store.load(Path(directory) / path.name, own)
    if step is None:
        raise RuntimeError(f"the compiled step {path} does not load; delete it and try again")
    sizes = {n: torch.empty(n, 0, device=model.device) for n in range(1, cache.k[0].shape[2] // CHUNK + 1)}
    kv, given = (*cache.k, *cache.v), [(t, t.data_ptr()) for t in (own or {}).values()]

    def run(ids: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        if any(t.data_ptr() != address for t, address in given):  # (the library reads them there)
            raise RuntimeError("the model's weights moved (converted, replaced) after its step was compiled")
        return step(ids, pos, sizes[-(-span // CHUNK)], model.embed(ids, pos), *kv)

    return run


def jit_step(model: GPT, cache: KVCache, progress: Progress = None, width: int = 1) -> Step:
    """The step compiled by ``torch.compile`` in this process (CUDA: ``reduce-overhead``), run once; it
    reads the whole cache whatever span it is given."""

    def step(tokens: torch.Tensor, positions: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        # The buffers are inputs, not captured: a graph dynamo keeps serves another engine's cache too.
        buffers = KVCache.over(kv[: len(kv) // 2], kv[len(kv) // 2 :])
        return runner.forward_step(model, buffers, tokens, positions, buffers.max_len)

    # A code object per engine shape: dynamo keeps graphs, and counts recompiles (at most 8), per code object,
    # so an engine of a shape seen before reuses its graph and other shapes never count against its limit.
    weights = tuple((name, t.dtype, t.shape) for name, t in model.state_dict().items())  # (quantized or not)
    shape = (model.config, weights, model.device, cache.k[0].dtype, cache.slots, cache.max_len, width)
    code = CODES.setdefault(shape, step.__code__.replace())
    step = types.FunctionType(code, step.__globals__, "step", None, step.__closure__)
    cuda = model.device.type == "cuda"  # (CUDA graphs replay at fixed addresses; the CPU's freezing would
    for buffer in (*cache.k, *cache.v) if cuda else ():  # fold a buffer so marked into the graph)
        torch._dynamo.mark_static_address(buffer)
    compiled = torch.compile(step, mode="reduce-overhead" if cuda else None, fullgraph=True, dynamic=False)
    what = f"compiling the decode step ({cache.slots} slots x {cache.max_len} positions)"
    with _progress(what, progress), torch.inference_mode():  # (the engine's steps are; dynamo guards on it)
        tokens = torch.zeros(cache.slots, width, dtype=torch.long, device=model.device)
        positions = torch.arange(width, device=model.device).repeat(cache.slots, 1)
        compiled(tokens, positions, *cache.k, *cache.v)  # writes the first positions (cleared on join)
    return lambda tokens, positions, span: compiled(tokens, positions, *cache.k, *cache.v)


def compile_steps(model: GPT, cache: KVCache, progress: Progress = None,
                  widths: tuple[int, ...] = (1,)) -> dict[int, Step]:  # fmt: skip
    """The compiled steps of ``model`` over ``cache`` for ``widths`` (width -> :data:`Step`): on the CPU a
    library each, but a speculating lone slot's widths up to :data:`TEMPLATE_ROWS` share one (with AVX-512);
    on CUDA ``torch.compile``'s, one each."""
    if model.device.type != "cpu":
        return {w: jit_step(model, cache, progress, w) for w in sorted(set(widths))}
    if torch.__version__ < (2, 13):  # (the suite's torch: 2.11-2.12 fail to build int4's template)
        raise RuntimeError(f"compiling on the CPU needs torch 2.13 or newer, not {torch.__version__}: "
                           "pip install torch==2.13.0, or generate without compiling")  # fmt: skip
    steps = {}
    if AVX512 and cache.slots == 1 and max(widths) > 1:  # (else: its own)
        shared = packaged_step(model, cache, progress, (1, TEMPLATE_ROWS))
        steps = dict.fromkeys(range(1, TEMPLATE_ROWS + 1), shared)
    return steps | {w: packaged_step(model, cache, progress, (w,)) for w in set(widths) - set(steps)}
