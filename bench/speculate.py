"""Speculative decoding's speed: plain decoding against prompt lookup (and a draft model, if given), eager
and compiled, greedy and with the CLI's default sampling, in one process, in alternating rounds.

    python bench/speculate.py                       # the shipped model, 4 prompts from its held-out text
    python bench/speculate.py --draft path/to/draft --compile --rounds 5

Prints tokens per second (median and range over rounds) for each way, its ratio to plain decoding of the same
kind, the acceptance rate and the tokens a row gains per step. The outputs of every way are checked equal to
plain decoding's (tokens), as the tests promise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import generate
from generate.engine.request import Request
from generate.engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def _prompts(gen: generate.Generator, count: int, length: int) -> list[list[int]]:
    """``count`` excerpts of ``length`` tokens from the shipped model's held-out text."""
    ids = gen.encode((ROOT / "checkpoints" / "shakespeare" / "heldout.txt").read_text(encoding="utf-8"))
    step = (len(ids) - length) // count
    return [ids[i * step : i * step + length] for i in range(count)]


def _run(gen: generate.Generator, prompts: list[list[int]], sampling: SamplingParams, new: int):
    engine = gen.engine(gen.width(len(prompts)), max(map(len, prompts)) + new)
    rows = [engine.add(Request(p, sampling, new, seed=i, eos_id=None)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for _ in engine.run():
        pass
    return time.perf_counter() - start, [r.token_ids for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shakespeare", help="the target checkpoint (default: the shipped one)")
    p.add_argument("--draft", help="a draft checkpoint sharing the tokenizer (besides prompt lookup)")
    p.add_argument("--compile", action="store_true", help="also time compiled steps")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=1, help="prompts run at once (default 1: batch 1)")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--new", type=int, default=128, help="tokens generated per prompt (default 128)")
    args = p.parse_args()
    plain = generate.load(args.model, slots=args.prompts)
    ways = {"plain": plain, "ngram": generate.Generator(plain.model, slots=args.prompts, draft="ngram")}
    if args.draft:
        draft = generate.load(args.draft).model
        ways["draft"] = generate.Generator(plain.model, slots=args.prompts, draft=draft)
    if args.compile:
        for name, gen in list(ways.items()):
            ways[f"{name} compiled"] = generate.Generator(gen.model, slots=args.prompts, draft=gen.draft,
                                                          compile=True)  # fmt: skip
    prompts = _prompts(plain, args.prompts, args.prompt_tokens)
    for label, sampling in (("greedy", SamplingParams(temperature=0)),
                            ("t=0.8 top-p=0.95", SamplingParams(temperature=0.8, top_p=0.95))):  # fmt: skip
        rates: dict[str, list[float]] = {name: [] for name in ways}
        outputs: dict[str, list[list[int]]] = {}
        for name, gen in ways.items():  # (a first run: compiles, warms up; the counts start after it)
            outputs[name] = _run(gen, prompts, sampling, args.new)[1]
        before = {name: gen.speculation for name, gen in ways.items()}
        for _ in range(args.rounds):
            for name, gen in ways.items():
                seconds, _ = _run(gen, prompts, sampling, args.new)
                rates[name].append(args.new * len(prompts) / seconds)
        print(f"\n{label}, {len(prompts)} prompt(s) of {args.prompt_tokens} tokens, {args.new} new, "
              f"{args.rounds} rounds")  # fmt: skip
        for name, values in rates.items():
            base = statistics.median(rates["plain compiled" if "compiled" in name else "plain"])
            stats, extra = ways[name].speculation, ""
            if stats is not None:  # this label's rounds alone
                d = {
                    key: stats[key] - before[name][key]
                    for key in ("proposed", "accepted", "passes", "tokens")
                }
                rate, per = d["accepted"] / max(d["proposed"], 1), d["tokens"] / max(d["passes"], 1)
                extra = f"  acceptance {rate:.2f}, {per:.2f} tokens a step"
            same = "same tokens" if outputs[name] == outputs["plain"] else "TOKENS DIFFER from plain"
            print(f"  {name:16s} {statistics.median(values):7.1f} tok/s ({min(values):.1f}-{max(values):.1f})"
                  f"  {statistics.median(values) / base:.2f}x{extra}  [{same}]")  # fmt: skip


if __name__ == "__main__":
    main()
