"""The eager decode step reading the span that holds its rows, against reading every cache position.

    python bench/span.py                                  # GPT-2 124M geometry, random weights, fp32
    python bench/span.py --dtypes float32,bfloat16,int8 --slots 1,8 --rounds 5
    python bench/span.py --model DIR --max-len 512

One eager engine of ``--max-len`` positions a slot (default the window, as ``gptgen serve`` makes it) runs
the same requests (``--prompt`` random tokens each, ``--new`` greedy tokens) both ways, taking turns in
one process: its runner's spans set to every position alone, then to the spans it follows
(``generate.runner.decode_spans``). Prints decode tokens per second (prefill and the first step excluded),
medians over rounds, the ratio, and whether both ways chose the same tokens. Also what the check at start
(``generate.probes.spans_agree``) found on this machine: where it found spans that differ, the engine
reads every position, and the following rows are only a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import checkpoints  # noqa: E402
from bench import checkpoint_dir, cpu_description  # noqa: E402  (bench/bench.py, beside this script)
from generate.engine import Engine  # noqa: E402
from generate.request import Request  # noqa: E402
from generate.runner import decode_spans  # noqa: E402
from generate.sampling import SamplingParams  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an HF-layout checkpoint (default: random weights of GPT-2 124M geometry)")
    p.add_argument("--dtypes", default="float32", help="comma-separated, e.g. float32,bfloat16,int8,int4")
    p.add_argument("--slots", default="1,8", help="comma-separated engine widths (one request per slot)")
    p.add_argument("--max-len", type=int, help="positions a slot holds (default the model's window)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per request")
    p.add_argument("--new", type=int, default=64, help="greedy tokens per request")
    p.add_argument("--rounds", type=int, default=5)
    return p.parse_args()


def run(engine: Engine, prompts: list[list[int]], new: int, spans: tuple[int, ...]) -> tuple[float, list]:
    """Decode tokens per second of one run of the prompts with the runner reading ``spans``."""
    engine.runner.spans = spans
    requests = [Request(p, SamplingParams(temperature=0), new, eos_id=None) for p in prompts]
    for r in requests:
        engine.add(r)
    engine.step()  # prefill and the first decode step
    start, tokens = time.perf_counter(), 0
    while engine.has_work:
        tokens += len(engine.step())
    return tokens / (time.perf_counter() - start), [r.token_ids for r in requests]


def main() -> None:
    args = _args()
    print(f"torch {torch.__version__}, torch threads {torch.get_num_threads()}", flush=True)
    print(cpu_description(), flush=True)
    with checkpoint_dir(args.model) as directory:
        models = {dtype: checkpoints.load(directory, dtype=dtype).eval() for dtype in args.dtypes.split(",")}
    print(f"model: {args.model or 'GPT-2 124M geometry, random weights'}; prompts of {args.prompt} tokens, "
          f"{args.new} greedy tokens, {args.rounds} rounds", flush=True)  # fmt: skip
    for dtype, model in models.items():
        max_len = args.max_len or model.config.n_positions
        generator = torch.Generator().manual_seed(0)
        for slots in map(int, args.slots.split(",")):
            engine = Engine(model, slots=slots, max_len=max_len)
            follow, every = decode_spans(max_len), (max_len,)
            checked = "agree" if engine.runner.spans == follow else "differ: the engine reads every position"
            prompts = [torch.randint(0, model.config.vocab_size, (args.prompt,), generator=generator).tolist()
                       for _ in range(slots)]  # fmt: skip
            run(engine, prompts, args.new, follow)  # warm-up
            rates: dict[str, list[float]] = {"every": [], "follow": []}
            tokens = {}
            for _ in range(args.rounds):
                for name, spans in (("every", every), ("follow", follow)):
                    rate, tokens[name] = run(engine, prompts, args.new, spans)
                    rates[name].append(rate)
            a, b = (statistics.median(rates[k]) for k in ("every", "follow"))
            print(f"{dtype} batch {slots}, {max_len} positions: every position {a:.2f} tok/s, the span of "
                  f"the rows {b:.2f} ({b / a:.2f}x); same tokens {tokens['every'] == tokens['follow']}; "
                  f"the check here: spans {checked}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
