"""Speculative decoding's speed: plain decoding against prompt lookup (and a draft model, if given), eager
and compiled, greedy and with the CLI's default sampling, in one process, in alternating rounds; and the
cost of a verify pass against a decode step.

    python bench/speculative.py                     # the shipped model, held-out prompts and quoted ones
    python bench/speculative.py --draft path/to/draft --compile --rounds 5
    python bench/speculative.py --verify-cost --compile   # GPT-2 124M geometry, k = 1..8

Prints tokens per second (median and range over rounds) for each way, its ratio to plain decoding of the same
kind, the acceptance rate and the tokens a row gains per step, for two kinds of prompt: excerpts of the
held-out text (little repeats) and passages quoted twice (the prompt ends with the start of a passage it holds
earlier, so a model that copies goes on with it: it prints how far plain decoding does). The outputs of every
way are checked equal to plain decoding's (tokens), as the tests promise. ``--verify-cost`` times one step of
``1 + k`` tokens per row against a plain decode step (k = 0), the ceiling on what speculation can give.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch

import checkpoints
import generate
from generate.engine.request import Request
from generate.engine.runner import Runner
from generate.engine.sampling import SamplingParams
from model import KVCache

ROOT = Path(__file__).resolve().parent.parent


def _prompts(gen: generate.Generator, count: int, length: int) -> dict[str, list[list[int]]]:
    """``count`` excerpts of ``length`` tokens from the shipped model's held-out text, and as many passages
    quoted twice: an excerpt, a blank line, then the excerpt's first quarter again."""
    ids = gen.encode((ROOT / "checkpoints" / "shakespeare" / "heldout.txt").read_text(encoding="utf-8"))
    step = (len(ids) - length) // count
    excerpts = [ids[i * step : i * step + length] for i in range(count)]
    gap = gen.encode("\n\n")
    return {"held-out": excerpts, "quoted twice": [e + gap + e[: length // 4] for e in excerpts]}


def _run(gen: generate.Generator, prompts: list[list[int]], sampling: SamplingParams, new: int):
    engine = gen.engine(gen.width(len(prompts)), max(map(len, prompts)) + new)
    rows = [engine.add(Request(p, sampling, new, seed=i, eos_id=None)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for _ in engine.run():
        pass
    return time.perf_counter() - start, [r.token_ids for r in rows]


def _speeds(args: argparse.Namespace) -> None:
    plain = generate.load(args.model, slots=args.prompts, device=args.device)
    ways = {"plain": plain, "ngram": generate.Generator(plain.model, slots=args.prompts, draft="ngram")}
    if args.draft:
        draft = generate.load(args.draft, device=args.device).model
        ways["draft"] = generate.Generator(plain.model, slots=args.prompts, draft=draft)
    if args.compile:
        for name, gen in list(ways.items()):
            ways[f"{name} compiled"] = generate.Generator(gen.model, slots=args.prompts, draft=gen.draft,
                                                          compile=True)  # fmt: skip
    samplings = {"greedy": SamplingParams(temperature=0),
                 "t=0.8 top-p=0.95": SamplingParams(temperature=0.8, top_p=0.95)}  # fmt: skip
    for kind, prompts in _prompts(plain, args.prompts, args.prompt_tokens).items():
        for label, sampling in samplings.items():
            print(f"\n{kind}, {label}: {len(prompts)} prompt(s) of {len(prompts[0])} tokens, {args.new} new, "
                  f"{args.rounds} rounds")  # fmt: skip
            outputs = _compare(ways, prompts, sampling, args)
            if kind == "quoted twice":  # (prompt lookup can only gain where the model repeats the quote)
                quotes = [p[args.prompt_tokens // 4 : args.prompt_tokens] for p in prompts]
                same = [_repeated(out, quote) for out, quote in zip(outputs, quotes, strict=True)]
                print(f"  plain decoding repeats the quoted passage for its first {statistics.median(same)} "
                      f"tokens (median; {min(same)}-{max(same)})")  # fmt: skip


def _repeated(output: list[int], quote: list[int]) -> int:
    """How many of ``output``'s first tokens are ``quote``'s."""
    return sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(output, quote, strict=False)))


def _compare(
    ways: dict, prompts: list[list[int]], sampling: SamplingParams, args: argparse.Namespace
) -> list[list[int]]:
    """Time every way on ``prompts`` in alternating rounds and print each against plain decoding; return
    plain decoding's tokens."""
    rates: dict[str, list[float]] = {name: [] for name in ways}
    outputs: dict[str, list[list[int]]] = {}
    for name, gen in ways.items():  # (a first run: compiles, warms up; the counts start after it)
        outputs[name] = _run(gen, prompts, sampling, args.new)[1]
    before = {name: gen.speculation for name, gen in ways.items()}
    for _ in range(args.rounds):
        for name, gen in ways.items():
            seconds, _ = _run(gen, prompts, sampling, args.new)
            rates[name].append(args.new * len(prompts) / seconds)
    for name, values in rates.items():
        base = statistics.median(rates["plain compiled" if "compiled" in name else "plain"])
        stats, extra = ways[name].speculation, ""
        if stats is not None:  # these rounds alone
            d = {key: stats[key] - before[name][key] for key in ("proposed", "accepted", "passes", "tokens")}
            rate, per = d["accepted"] / max(d["proposed"], 1), d["tokens"] / max(d["passes"], 1)
            extra = f"  acceptance {rate:.2f}, {per:.2f} tokens a step"
        same = "same tokens" if outputs[name] == outputs["plain"] else "TOKENS DIFFER from plain"
        print(f"  {name:16s} {statistics.median(values):7.1f} tok/s ({min(values):.1f}-{max(values):.1f})"
              f"  {statistics.median(values) / base:.2f}x{extra}  [{same}]", flush=True)  # fmt: skip
    return outputs["plain"]


def _verify_cost(args: argparse.Namespace) -> None:
    """One step of 1 + k tokens per row against a plain decode step, eager and compiled."""
    import bench  # bench/bench.py: the random GPT-2 124M checkpoint

    with bench.checkpoint_dir(None if args.model == "shakespeare" else args.model) as directory:
        model = checkpoints.load(directory, dtype=args.dtype, device=args.device)
    cuda = model.device.type == "cuda"
    where = torch.cuda.get_device_name(model.device) if cuda else bench.cpu_description()
    print(f"verify pass of 1 + k tokens against one decode step, batch 1, {args.dtype}, cache at position "
          f"{args.position}, median of {args.calls} calls ({where})")  # fmt: skip
    kinds = [False, True] if args.compile else [False]
    base: dict[bool, float] = {}
    for k in range(0, 9):
        line = f"  k={k}"
        for compiled in kinds:
            cache = KVCache(model.config, 1, model.config.n_positions, dtype=model.compute_dtype,
                            device=model.device)  # fmt: skip
            runner = Runner(model, cache, compile=compiled, widths=(k + 1,))
            runner.prefill(list(range(args.position)), 0)
            ms = 1000 * _step_seconds(runner, k, args.position, args.calls)
            base.setdefault(compiled, ms)
            line += f"  {'compiled' if compiled else 'eager'} {ms:7.2f} ms ({ms / base[compiled]:.2f}x)"
        print(line, flush=True)


def _step_seconds(runner: Runner, k: int, position: int, calls: int) -> float:
    """The median time of a step feeding ``1 + k`` tokens at ``position`` (k = 0: a plain decode step)."""
    device = runner.model.device
    tokens = torch.zeros(1, k + 1, dtype=torch.long, device=device)
    positions = torch.arange(position, position + k + 1, device=device)[None]
    times = []
    with torch.inference_mode():
        for i in range(3 + calls):
            start = time.perf_counter()
            if k == 0:
                runner.decode(tokens[:, 0], positions[:, 0])
            else:
                runner.verify(tokens, positions)
            if device.type == "cuda":  # (CUDA runs asynchronously: wait for the step's kernels)
                torch.cuda.synchronize(device)
            if i >= 3:  # (warm-up calls first)
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shakespeare", help="the target checkpoint (default: the shipped one; "
                   "with --verify-cost, random weights of GPT-2 124M geometry)")  # fmt: skip
    p.add_argument("--draft", help="a draft checkpoint sharing the tokenizer (besides prompt lookup)")
    p.add_argument("--compile", action="store_true", help="also time compiled steps")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=1, help="prompts run at once (default 1: batch 1)")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--new", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--verify-cost", action="store_true", help="time verify passes of k = 1..8 instead")
    p.add_argument("--dtype", default="float32", help="with --verify-cost: the weights' dtype")
    p.add_argument("--position", type=int, default=256, help="with --verify-cost: the cache's length")
    p.add_argument("--device", default="cpu", help="where to run: cpu (default), cuda, cuda:N")
    p.add_argument("--calls", type=int, default=30, help="with --verify-cost: timed calls per width")
    args = p.parse_args()
    (_verify_cost if args.verify_cost else _speeds)(args)


if __name__ == "__main__":
    main()
