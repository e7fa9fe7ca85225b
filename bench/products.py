"""Where a decode step's time goes: GPT-2 124M's products at one row, each against the bytes it reads.

    python bench/products.py                              # every dtype, eager kernels (a minute)
    python bench/products.py --dtypes int4 --compile      # also AOTInductor's GEMM template and ATen's

A decode step at batch 1 is its 48 products (c_attn, attn c_proj, c_fc, mlp c_proj in each of 12 layers) and
the head, plus little else; each product should cost about its weights' bytes over the read bandwidth. The
products are built from the model's own layers (``nn.Linear``, ``Int8Linear``, ``Int4Linear``; random
weights, one row in) and run as a step runs them, layer after layer, then the head, each call timed alone, so
each finds its weights out of the caches as in a step. With ``--compile``, each kind of product is also a
library of its step's count of them (12, the head 1) called in turn, over the C++ GEMM template (with
AVX-512: a decode step's) and over ATen's kernels; there a kind's 12 weights may partly stay in the caches.
Prints per product milliseconds, GB/s and the fraction of the read bandwidth (a sum over 1 GiB), and the
products summed over a step as a ceiling in tokens/s. Medians of rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import bench  # bench/bench.py: cpu_description, read_bandwidth (and the project on sys.path)
from generate.engine.compiled import AVX512, CPU_OPTIONS
from model.int4 import Int4Linear
from model.quant import Int8Linear

# (out, in) of GPT-2 124M's products, and how many a decode step runs
PRODUCTS = {"c_attn": (2304, 768), "attn c_proj": (768, 768), "c_fc": (3072, 768), "mlp c_proj": (768, 3072)}
HEAD = (50257, 768)
LAYERS = 12


def _layer(dtype: str, out: int, width: int, group_size: int) -> tuple[nn.Module, float]:
    """The model's layer for one product in ``dtype`` (random weights) and its weights' bytes (no bias)."""
    linear = nn.Linear(width, out, bias=False)
    nn.init.normal_(linear.weight, std=0.02)
    n = out * width
    if dtype == "int8":
        return Int8Linear(linear).eval(), n + 2 * out
    if dtype == "int4":
        return Int4Linear.from_linear(linear, group_size).eval(), n / 2 + 4 * n / group_size
    kind = getattr(torch, dtype)
    return linear.to(kind).eval(), n * torch.finfo(kind).bits / 8


class Copies(nn.Module):
    """Its layers called in turn on the same row (their outputs stacked: none is dead code)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([layer(x) for layer in self.layers])


def _library(module: nn.Module, x: torch.Tensor, backend: str):
    """``module`` compiled by AOTInductor (frozen weights) over ``backend``'s GEMM kernels."""
    options = {**CPU_OPTIONS, "max_autotune_gemm_backends": backend}
    with torch.no_grad(), tempfile.TemporaryDirectory() as work:
        exported = torch.export.export(module, (x,))
        path = torch._inductor.aoti_compile_and_package(
            exported, package_path=str(Path(work) / "products.pt2"), inductor_configs=options
        )
        return torch._inductor.aoti_load_package(path)


def _timed(fn, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    fn(x)
    return time.perf_counter() - t0


def _row(dtype: str, name: str, nbytes: float, bandwidth: float, times: dict[str, float]) -> str:
    cells = [f"{k} {t * 1e3:6.3f} ms {nbytes / t / 1e9:5.1f} GB/s ({nbytes / t / bandwidth:4.0%})"
             for k, t in times.items()]  # fmt: skip
    return f"[{dtype}] {name:11s} {nbytes / 2**20:6.1f} MiB: " + " | ".join(cells)


@torch.inference_mode()
def _dtype_rows(dtype: str, args: argparse.Namespace, bandwidth: float) -> None:
    """Build a step's products in ``dtype``, time them (eager; with --compile, each kind as a library) and
    print a row per kind of product and one for the step."""
    kinds = {**PRODUCTS, "head": HEAD}
    built = {name: [_layer(dtype, *shape, args.group_size) for _ in range(1 if name == "head" else LAYERS)]
             for name, shape in kinds.items()}  # fmt: skip
    inputs = {name: torch.randn(1, shape[1]).to(torch.float32 if dtype == "float32" else torch.bfloat16)
              for name, shape in kinds.items()}  # fmt: skip
    order = [(name, i) for i in range(LAYERS) for name in PRODUCTS] + [("head", 0)]
    times: dict[str, dict[str, list[float]]] = {name: {"eager": []} for name in kinds}
    libraries = {}
    if args.compile:
        for name, layers in built.items():
            backends = ("CPP", "ATEN") if AVX512 else ("ATEN",)
            for backend in backends:
                kernel = "template" if backend == "CPP" else "aten"
                libraries[name, kernel] = _library(Copies([m for m, _ in layers]), inputs[name], backend)
                times[name][kernel] = []
    for round_ in range(args.rounds + 1):  # (the first: a warm-up)
        step = {name: 0.0 for name in kinds}
        for name, i in order:
            step[name] += _timed(built[name][i][0], inputs[name])
        for (name, kernel), library in libraries.items():
            step_time = _timed(library, inputs[name])
            if round_:
                times[name][kernel].append(step_time / len(built[name]))
        if round_:
            for name in kinds:
                times[name]["eager"].append(step[name] / len(built[name]))
    totals: dict[str, float] = {}
    for name in kinds:
        medians = {k: statistics.median(ts) for k, ts in times[name].items()}
        for k, t in medians.items():
            totals[k] = totals.get(k, 0.0) + t * len(built[name])
        print(_row(dtype, name, built[name][0][1], bandwidth, medians))
    read = sum(nbytes * len(layers) for layers in built.values() for _, nbytes in layers[:1])
    step = " | ".join(f"{k} {t * 1e3:.2f} ms, {1 / t:.0f} tok/s" for k, t in totals.items())
    print(f"[{dtype}] a step's products ({read / 2**20:.0f} MiB): {step}; bandwidth's {bandwidth / read:.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16,int8,int4", help="comma-separated (default: all)")
    p.add_argument("--group-size", type=int, default=32, help="int4's group size (default 32, the loader's)")
    p.add_argument("--compile", action="store_true", help="also time each kind compiled (template, ATen)")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    torch.manual_seed(0)
    bandwidth = bench.read_bandwidth()
    print(f"{bench.cpu_description()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s (a sum over 1 GiB, best of 5)")  # fmt: skip
    for dtype in args.dtypes.split(","):
        _dtype_rows(dtype, args, bandwidth)


if __name__ == "__main__":
    main()
