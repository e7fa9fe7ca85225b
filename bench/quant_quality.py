"""Quality cost of int8 and int4 weights on the shipped checkpoint, measured on its held-out text.

    python bench/quant_quality.py [--checkpoint shakespeare] [--tokens 16384]

Teacher-forced over the held-out works (Macbeth, Twelfth Night): next-token top-1 agreement of each quantized
model with our fp32 model, and each model's loss, for int8 and int4 (at each group size) with and without
the output head quantized.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import checkpoints
from checkpoints.corpus import prepare
from model.int4 import GROUP_SIZES


@torch.inference_mode()
def evaluate(model, tokens: torch.Tensor, window: int) -> tuple[float, torch.Tensor]:
    """Mean loss and the argmax predictions over consecutive windows of ``tokens``."""
    losses, preds = [], []
    for start in range(0, len(tokens) - 1 - window + 1, window):
        x = tokens[start : start + window + 1]
        logits = model(x[None, :-1])[0].float()
        losses.append(F.cross_entropy(logits, x[1:], reduction="sum"))
        preds.append(logits.argmax(-1))
    preds = torch.cat(preds)
    return (torch.stack(losses).sum() / len(preds)).item(), preds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="shakespeare")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens to evaluate")
    p.add_argument(
        "--work-dir", type=Path, default=Path("runs/shakespeare"), help="where the corpus is cached"
    )
    args = p.parse_args()
    _, val = prepare(args.work_dir)
    tokens = torch.from_numpy(val[: args.tokens + 1].astype("int64"))
    reference = checkpoints.load(args.checkpoint)
    window = reference.config.n_positions
    ref_loss, ref_pred = evaluate(reference, tokens, window)
    print(f"{len(ref_pred)} held-out tokens of {args.checkpoint}, windows of {window}")
    print("| dtype | group size | output head | held-out loss | vs fp32 (nats) | top-1 agreement with fp32 |")
    print("|---|---|---|---|---|---|")
    print(f"| float32 | | fp32 | {ref_loss:.4f} | | |")
    for mode, (bits, head) in checkpoints.QUANT_MODES.items():
        for group_size in GROUP_SIZES if bits == 4 else [None]:
            model = checkpoints.load(args.checkpoint, dtype=mode, group_size=group_size)
            loss, pred = evaluate(model, tokens, window)
            agree = (pred == ref_pred).float().mean().item()
            group = group_size or "row"
            print(f"| {mode} | {group} | {f'int{bits}' if head else 'bf16'} | {loss:.4f} | "
                  f"{loss - ref_loss:+.4f} | {agree:.2%} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
