"""The compiled decode step: one graph per engine shape, compiled by inductor and cached on disk.

Settings, measured on GPT-2 124M geometry (2 cores, AMD EPYC Zen 4, batch 1, medians of 40 steps; see the
README): on the CPU, ``freezing`` (weights become constants, prepacked for the GEMM kernels) with
``max_autotune`` and the C++ GEMM template ran a step in 18-19 ms in fp32 (eager: 42 ms) and 12 ms in bf16
(eager: 24 ms); without freezing the template was no faster than eager (39 ms). On CUDA the step runs as a
CUDA graph (``reduce-overhead``).

Inductor keeps what it compiled, and what autotuning measured, in its cache directory, which this module
points at the user's cache (``$XDG_CACHE_HOME/gptgen/inductor``, unless ``TORCHINDUCTOR_CACHE_DIR`` is set).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from model import GPT, KVCache

log = logging.getLogger("gptgen")

CPU_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def cache_dir() -> Path:
    """Where compiled artifacts are kept: ``$XDG_CACHE_HOME/gptgen`` (default ``~/.cache/gptgen``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptgen"


def compile_step(model: GPT, cache: KVCache) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Compile the decode step of ``model`` over ``cache`` and run it once (the compile happens then).

    The step takes (slots, 1) token ids and positions and returns (slots, V) logits of the last position,
    attending over all ``cache.max_len`` positions of every slot: static shapes, one graph.
    """
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model(tokens, positions=positions, cache=cache, last_only=True)[:, -1]

    if model.device.type == "cuda":
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    else:
        compiled = torch.compile(step, options=dict(CPU_OPTIONS), fullgraph=True, dynamic=False)
    start = time.perf_counter()
    log.info("compiling the decode step (%d slots x %d positions)", cache.slots, cache.max_len)
    # Inputs made as the engine makes them (inference tensors, not one tensor twice): dynamo guards on both,
    # and a guard that fails at the first real step recompiles, which costs as much as the first compile.
    with torch.inference_mode():
        tokens = torch.zeros(cache.slots, 1, dtype=torch.long, device=model.device)
        positions = torch.zeros_like(tokens)
        compiled(tokens, positions)  # writes position 0 of every slot; a slot is cleared as a request joins
    log.info("decode step compiled in %.1f s", time.perf_counter() - start)
    return compiled
