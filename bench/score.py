"""Scoring speed, side by side: gptgen's ``Generator.score`` vs transformers on the same weights and text.

    python bench/score.py                      # the shipped model on its held-out text (first 16,384 tokens)
    python bench/score.py --gpt2 --tokens 8192 # random weights of GPT-2 124M geometry
    python bench/score.py --model DIR --text FILE

Both score the same tokens with the same windows (``generate.score.plan_windows``: windows of n_positions
tokens whose ends advance by the stride) in fp32, so their mean NLLs must agree; the run checks that first.
transformers runs two ways: its perplexity guide's loop (one window a call, ``labels`` with -100 on the
context, the loss from all the window's logits) and batched like ours with ``logits_to_keep`` (only the
positions it scores). Rounds alternate the three; medians of scored tokens per second, and ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import generate  # noqa: E402
from bench import checkpoint_dir, cpu_description  # noqa: E402  (bench/bench.py, beside this script)
from generate.score import plan_windows  # noqa: E402


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shipped = ROOT / "checkpoints" / "shakespeare"
    p.add_argument("--model", default=str(shipped), help="an HF-layout checkpoint (default the shipped one)")
    p.add_argument("--gpt2", action="store_true", help="random weights of GPT-2 124M geometry instead")
    p.add_argument("--text", default=str(shipped / "heldout.txt"), help="default the held-out works")
    p.add_argument("--tokens", type=int, default=16_384, help="score the text's first N tokens")
    p.add_argument("--stride", type=int, help="default half the window")
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward (ours and HF batched)")
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args()


@torch.inference_mode()
def hf_guide(hf, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """transformers' perplexity-guide loop: one window a call; context positions labelled -100."""
    total, count = 0.0, 0
    for w in plan_windows(len(ids), window, stride):
        x = torch.tensor([ids[w.begin : w.end]])
        labels = x.clone()
        labels[:, : w.first - w.begin] = -100
        n = w.end - w.first
        total += hf(x, labels=labels).loss.item() * n  # (the loss is a mean over the n labelled tokens)
        count += n
    return total / count, count


@torch.inference_mode()
def hf_batched(hf, ids: list[int], window: int, stride: int, batch_size: int) -> tuple[float, int]:
    """transformers batched like ours, computing logits only for the positions that score (logits_to_keep)."""
    windows = plan_windows(len(ids), window, stride)
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        keep = max(w.end - w.first for w in batch) + 1
        logits = hf(torch.tensor([ids[w.begin : w.end] for w in batch]), logits_to_keep=keep).logits
        for row, w in zip(logits, batch, strict=True):
            n = w.end - w.first
            scored = row[keep - 1 - n : keep - 1].float()  # positions first-1 .. end-2
            targets = torch.tensor(ids[w.first : w.end])
            total += torch.nn.functional.cross_entropy(scored, targets, reduction="sum").item()
            count += n
    return total / count, count


def main() -> None:
    args = _args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"torch threads {torch.get_num_threads()}", flush=True)  # fmt: skip
    print(cpu_description(), flush=True)
    with checkpoint_dir(None if args.gpt2 else args.model) as directory:
        gen = generate.load(directory)
        hf = transformers.GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float32).eval()
    window = gen.model.config.n_positions
    stride = args.stride or window // 2
    ids = gen.tokenizer.encode_ordinary(Path(args.text).read_text(encoding="utf-8"))[: args.tokens]
    name = "GPT-2 124M geometry, random weights" if args.gpt2 else directory
    print(f"model {name}; {len(ids):,} tokens of {args.text}; windows of {window}, stride {stride}, "
          f"{args.batch_size} windows a batch", flush=True)  # fmt: skip

    ours = gen.score(ids, stride=stride, batch_size=args.batch_size)
    guide_nll, guide_n = hf_guide(hf, ids, window, stride)
    batched_nll, batched_n = hf_batched(hf, ids, window, stride, args.batch_size)
    assert ours.tokens == guide_n == batched_n
    print(f"mean NLL: ours {ours.mean_nll:.6f}, HF guide {guide_nll:.6f}, HF batched {batched_nll:.6f} "
          f"(largest difference {max(abs(ours.mean_nll - guide_nll), abs(ours.mean_nll - batched_nll)):.1e})",
          flush=True)  # fmt: skip

    runs = {
        "gptgen Generator.score": lambda: gen.score(ids, stride=stride, batch_size=args.batch_size),
        "HF, the perplexity guide's loop": lambda: hf_guide(hf, ids, window, stride),
        "HF, batched, logits_to_keep": lambda: hf_batched(hf, ids, window, stride, args.batch_size),
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            rates[name].append(ours.tokens / (time.perf_counter() - start))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:,.0f}" for n, v in rates.items()),
              flush=True)  # fmt: skip
    mine = statistics.median(rates["gptgen Generator.score"])
    print("| | scored tokens/s (median) | ours / it |")
    print("|---|---|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {median:,.0f} | {'' if median == mine else f'{mine / median:.2f}x'} |")


if __name__ == "__main__":
    main()
