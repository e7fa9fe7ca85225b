"""Eager decode of this checkout against another checkout of gptgen, two live processes taking turns.

    git worktree add ../base de505cf                     # the code to compare with, e.g. before engine v2
    python bench/ab.py --base ../base                    # fp32, bf16 and int8 at batch 1 and 8
    python bench/ab.py --base ../base --dtypes int8 --batches 1 --pairs 40

Each checkout runs in its own worker process (its root first on ``sys.path``) that loads the same weights
(random GPT-2 124M geometry, seeded, or ``--model DIR``) and stays alive. The parent asks them in turn, A B
B A A B ..., for one timed run each of ``generate.engine.generate_ids``: ``--tokens`` greedy tokens for each
of ``--batches`` prompts (16, 19, 22... tokens), prefill excluded (a run of one token is subtracted). A
pair's ratio is this checkout's rate over the base's, taken a few seconds apart, so a machine whose speed
drifts (here the same step took 14-24 ms within minutes) moves both sides of a pair; the median and
quartiles of the pairs' ratios are printed, with the range of read bandwidths measured before each pair
(``--each`` prints every pair: some machines move between states in which routes compare differently).
Only ``checkpoints.load`` and ``generate_ids`` of the other
checkout are used (de505cf, before engine v2, has both). Eager only: the compiled step is measured by
``bench/bench.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the root of another gptgen checkout (e.g. a git worktree)")
    p.add_argument("--model", help="an HF-layout checkpoint (default: random weights of GPT-2 124M geometry)")
    p.add_argument("--dtypes", default="float32,bfloat16,int8", help="comma-separated dtypes both can load")
    p.add_argument("--batches", default="1,8", help="comma-separated prompt counts")
    p.add_argument("--pairs", type=int, default=30, help="timed runs of each side, per dtype and batch")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt in a timed run")
    p.add_argument("--each", action="store_true", help="print every pair, with the read bandwidth before it")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.worker and not (Path(args.base) / "generate").is_dir():
        p.error(f"--base {args.base}: not a gptgen checkout (no generate/ folder there)")
    if args.pairs < 2 or args.tokens < 2:
        p.error(f"--pairs ({args.pairs}) and --tokens ({args.tokens}) must be at least 2")
    if not all(b.isdigit() and int(b) > 0 for b in args.batches.split(",")):
        p.error(f"--batches {args.batches}: give positive prompt counts, e.g. 1,8")
    return args


def _worker(root: str, directory: str, dtype: str, batch: int, tokens: int) -> None:
    """One checkout's side: load, warm up, then answer each line on stdin with one timed rate."""
    sys.path.insert(0, root)  # before an installed copy of the project
    import checkpoints

    if Path(checkpoints.__file__).resolve().parents[1] != Path(root).resolve():
        raise SystemExit(f"the worker for {root} imported {checkpoints.__file__} instead")
    from generate.engine import generate_ids
    from generate.sampling import SamplingParams

    model = checkpoints.load(directory, dtype=dtype)
    prompts = [[(7 * i + 3 * j) % 50000 + 10 for j in range(16 + 3 * i)] for i in range(batch)]
    greedy = SamplingParams(temperature=0)

    def seconds(new: int) -> float:
        start = time.perf_counter()
        generate_ids(model, prompts, max_new_tokens=new, sampling=greedy, eos_id=None)
        return time.perf_counter() - start

    seconds(8)  # warm-up (and the route measurements of the first engine)
    print("ready", flush=True)
    for _ in sys.stdin:
        full, first = seconds(tokens + 1), seconds(1)
        print(json.dumps(batch * tokens / max(full - first, 1e-9)), flush=True)


class Side:
    """A checkout's worker process."""

    def __init__(self, root: Path, directory: str, dtype: str, batch: int, tokens: int) -> None:
        command = [sys.executable, __file__, "--base", str(root), "--worker", directory, dtype, str(batch),
                   str(tokens)]  # fmt: skip
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the worker of {root} failed to start ({dtype}, batch {batch}); see above")

    def rate(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise SystemExit(f"a worker stopped (exit code {self.proc.wait()}); see above")
        return float(answer)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def compare(base: Path, directory: str, dtype: str, batch: int, args: argparse.Namespace) -> None:
    """Time both sides in turn and print medians, the median paired ratio and its quartiles."""
    sides = {"base": Side(base, directory, dtype, batch, args.tokens),
             "this": Side(ROOT, directory, dtype, batch, args.tokens)}  # fmt: skip
    rates: dict[str, list[float]] = {"base": [], "this": []}
    bandwidths = []
    try:
        for i in range(args.pairs):
            bandwidths.append(_read_gbs())
            for name in ("base", "this") if i % 2 == 0 else ("this", "base"):
                rates[name].append(sides[name].rate())
            if args.each:
                this, base_rate = rates["this"][-1], rates["base"][-1]
                print(f"  pair {i + 1}: read {bandwidths[-1]:5.1f} GB/s, this {this:7.2f} tok/s, base "
                      f"{base_rate:7.2f}, ratio {this / base_rate:.3f}", flush=True)  # fmt: skip
    finally:
        for side in sides.values():
            side.close()
    ratios = [t / b for t, b in zip(rates["this"], rates["base"], strict=True)]
    low, _, high = statistics.quantiles(ratios, n=4)
    print(f"{dtype:>9} batch {batch}: this {statistics.median(rates['this']):7.2f} tok/s, base "
          f"{statistics.median(rates['base']):7.2f}; this / base {statistics.median(ratios):.3f} "
          f"(quartiles {low:.3f}-{high:.3f}, {len(ratios)} pairs; read {min(bandwidths):.0f}-"
          f"{max(bandwidths):.0f} GB/s)", flush=True)  # fmt: skip


@functools.cache
def _probe():  # -> torch.Tensor (torch is imported where it is used)
    import torch

    return torch.ones(2**26)  # 256 MiB, made once


def _read_gbs() -> float:
    """The read bandwidth now, in GB/s: a 256 MiB sum, best of 3 (about 30 ms). Some machines move between
    states (a 2-vCPU VM here between about 32 and 55 GB/s, minutes apart) in which routes compare
    differently, so each pair records it."""
    x = _probe()
    x.sum()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best / 1e9


def main() -> None:
    args = _args()
    if args.worker:
        directory, dtype, batch, tokens = args.worker
        _worker(args.base, directory, dtype, int(batch), int(tokens))
        return
    import torch

    from bench import checkpoint_dir, cpu_description  # bench/bench.py, beside this script

    print(f"torch {torch.__version__}, torch threads {torch.get_num_threads()}; {cpu_description()}")
    print(f"this: {ROOT}; base: {Path(args.base).resolve()}; eager, {args.tokens} greedy tokens a run")
    with checkpoint_dir(args.model) as directory:
        for dtype in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                compare(Path(args.base).resolve(), directory, dtype, batch, args)


if __name__ == "__main__":
    main()
