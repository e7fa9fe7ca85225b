"""Why a compiled step of several rows holds a copy of the weights: the two layouts inductor freezes into,
timed for one token's row and for a prompt's rows, against eager.

    python bench/layouts.py                       # fp32 and bf16, 1 and 512 rows
    python bench/layouts.py --dtypes bfloat16 --rows 1,4,64,512

GPT-2 124M's 48 products of a decode step (no attention, no head) are compiled by AOTInductor with frozen
weights into one library whose row count is a dynamic size, once over the C++ GEMM template's blocked weights
(``max_autotune_gemm_backends="CPP"``, the decode step's with AVX-512 at up to 4 rows) and once over oneDNN's
packed ones (``"ATEN"``, the step's otherwise). One library serving prompts and steps would hold the weights
once; it prints what each layout costs at each row count, so where one layout is fast at both (AMX may make
the template's bf16 prompts fast), the engine could use it. Medians of alternating calls.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import bench  # bench/bench.py: cpu_description


class Products(nn.Module):
    """GPT-2 124M's per-layer products (c_attn, attn c_proj, c_fc, mlp c_proj), 12 layers, with residuals."""

    def __init__(self, d: int = 768, layers: int = 12) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)])
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for qkv, proj, fc, out in self.layers:
            x = x + proj(qkv(x)[..., : x.shape[-1]])
            x = x + out(nn.functional.gelu(fc(x)))
        return x


def _library(model: nn.Module, dtype: torch.dtype, backend: str, most: int):
    """``model`` compiled by AOTInductor over ``backend``'s kernels, its row count dynamic (1..``most``)."""
    example = torch.randn(2, 768, dtype=dtype)  # (a dynamic size's example is not 1)
    rows = {0: torch.export.Dim("rows", min=1, max=most)}
    options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": backend}
    with torch.no_grad(), tempfile.TemporaryDirectory() as work:
        exported = torch.export.export(model, (example,), dynamic_shapes=(rows,))
        package = torch._inductor.aoti_compile_and_package(
            exported, package_path=str(Path(work) / "products.pt2"), inductor_configs=options
        )
        return torch._inductor.aoti_load_package(package)


def _median_ms(fn, x: torch.Tensor, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rows", default="1,512", help="row counts to time (comma-separated)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"GPT-2 124M's 48 products, ms a call, medians of {args.rounds} rounds ({bench.cpu_description()})")
    torch.manual_seed(0)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        model = Products().to(dtype).eval()
        libraries = {"template": "CPP", "oneDNN": "ATEN"}
        ways = {"eager": model, **{w: _library(model, dtype, b, max(rows)) for w, b in libraries.items()}}
        inputs = {r: torch.randn(r, 768, dtype=dtype) for r in rows}
        times: dict[tuple[str, int], list[float]] = {}
        with torch.no_grad():
            for _ in range(args.rounds):
                for r, x in inputs.items():
                    calls = max(3, min(50, 2000 // r))
                    for way, fn in ways.items():
                        times.setdefault((way, r), []).append(_median_ms(fn, x, calls))
        for r in rows:
            cells = "  ".join(f"{way} {statistics.median(times[way, r]):8.2f}" for way in ways)
            print(f"  {name:9s} {r:4d} rows:  {cells}", flush=True)


if __name__ == "__main__":
    main()
