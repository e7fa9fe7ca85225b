"""Train the shipped Shakespeare model: ``python -m checkpoints.train --out checkpoints/shakespeare``.

AdamW (weight decay on matrices only), linear warm-up then cosine decay, gradient clipping, bf16 autocast on
CPU, periodic held-out evaluation, a progress line with tokens/s. Resumable: every evaluation writes the
weights and optimizer moments as safetensors (no pickle) to ``--work-dir``; batches and dropout are seeded
from (seed, step), so a resumed run draws exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from checkpoints.corpus import HELD_OUT, HELD_OUT_FILE, PACKAGE, held_out_text, prepare, unigram_loss
from checkpoints.load import load
from checkpoints.save import save
from checkpoints.tokenizer import load_tokenizer
from checkpoints.train_card import write_card
from model import GPT, GPTConfig

SLICE_TOKENS = 256  # the fixed held-out slice whose loss the card records and a test recomputes


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m checkpoints.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("checkpoints/shakespeare"), help="where the model ships")
    p.add_argument("--work-dir", type=Path, default=Path("runs/shakespeare"), help="corpus and resume state")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--context", type=int, default=512, help="training window, also the model's n_positions")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=16, help="held-out windows in periodic evaluation")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--evaluate-only",
        action="store_true",
        help="do not train: re-evaluate the checkpoint in --out and rewrite its training.json and card",
    )
    args = p.parse_args(argv)
    _check(args, p)
    return args


def _check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Refuse bad values and paths as usage errors (exit 2), before any download or training."""
    least = {"n_layer": 1, "n_head": 1, "n_embd": 1, "context": 2, "batch_size": 1, "steps": 1, "warmup": 0,
             "eval_every": 1, "eval_windows": 1, "log_every": 1, "seed": 0}  # fmt: skip
    for name, low in least.items():
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    rules = {"lr": (args.lr > 0, "positive"), "min_lr": (0 <= args.min_lr <= args.lr, "in [0, --lr]"),
             "dropout": (0 <= args.dropout < 1, "in [0, 1)"), "clip": (args.clip > 0, "positive"),
             "weight_decay": (args.weight_decay >= 0, "a number >= 0")}  # fmt: skip
    for name, (ok, shown) in rules.items():
        if not (ok and math.isfinite(getattr(args, name))):
            p.error(f"--{name.replace('_', '-')} must be {shown}, got {getattr(args, name):g}")
    try:
        GPTConfig(n_positions=args.context, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head)
    except ValueError as e:
        p.error(str(e))
    for name in ("out", "work_dir"):
        path = getattr(args, name)
        if path.exists() and not path.is_dir():
            p.error(f"--{name.replace('_', '-')} {str(path)!r} is a file; give a folder")
    if args.evaluate_only and not (args.out / "training.json").is_file():
        p.error(f"--evaluate-only re-evaluates a trained checkpoint, but {args.out} has no training.json")


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``steps``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def batch(tokens: np.ndarray, step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Random training windows, drawn from a generator seeded by (seed, step)."""
    rng = np.random.default_rng([args.seed, step])
    starts = rng.integers(0, len(tokens) - args.context - 1, size=args.batch_size)
    rows = np.stack([tokens[s : s + args.context + 1] for s in starts]).astype(np.int64)
    rows = torch.from_numpy(rows)
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def heldout_loss(model: GPT, tokens: np.ndarray, context: int, windows: int | None, bf16: bool) -> float:
    """Mean next-token loss over consecutive non-overlapping windows of the held-out tokens (eval mode).

    The model's mode is restored afterwards: a model that came in for inference must not leave with
    dropout switched on.
    """
    was_training = model.training
    model.eval()
    n = (len(tokens) - 1) // context if windows is None else windows
    total, count = 0.0, 0
    for i in range(0, n, 8):
        rows = [tokens[j * context : j * context + context + 1] for j in range(i, min(n, i + 8))]
        xy = torch.from_numpy(np.stack(rows).astype(np.int64))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(xy[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), xy[:, 1:].flatten(), reduction="sum").item()
        count += xy[:, 1:].numel()
    model.train(was_training)
    return total / count


def _optimizer(model: GPT, args: argparse.Namespace) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # biases and LayerNorm gains
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def save_state(model: GPT, opt: torch.optim.AdamW, step: int, work: Path) -> None:
    """Write weights, optimizer moments and the step (safetensors + JSON), each file replaced atomically."""
    names = {p: n for n, p in model.named_parameters()}
    tensors = {f"model.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            value = st[key].detach()  # moments share their parameter's layout, which may be column-major
            tensors[f"opt.{names[p]}.{key}"] = value.reshape(-1) if key == "step" else value.contiguous()
    tmp = work / "state.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(work / "state.safetensors")
    (work / "state.json").write_text(json.dumps({"step": step}))


def load_state(model: GPT, opt: torch.optim.AdamW, work: Path) -> int:
    """Restore what :func:`save_state` wrote; return the step to continue from (0 if nothing saved)."""
    if not (work / "state.json").exists():
        return 0
    tensors = load_file(str(work / "state.safetensors"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[f"model.{n}"])
            if f"opt.{n}.step" in tensors:
                opt.state[p] = {
                    "step": tensors[f"opt.{n}.step"].reshape(()),
                    "exp_avg": torch.empty_like(p).copy_(tensors[f"opt.{n}.exp_avg"]),  # p's layout
                    "exp_avg_sq": torch.empty_like(p).copy_(tensors[f"opt.{n}.exp_avg_sq"]),
                }
    return json.loads((work / "state.json").read_text())["step"]


def _keep_best(model: GPT, step: int, val_loss: float, work: Path) -> None:
    """Keep the weights of the evaluation with the lowest held-out loss (early stopping)."""
    best = work / "best.json"
    if best.exists() and json.loads(best.read_text())["loss"] <= val_loss:
        return
    tmp = work / "best.safetensors.tmp"
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(tmp))
    tmp.replace(work / "best.safetensors")
    best.write_text(json.dumps({"step": step, "loss": val_loss}))


def main(argv: list[str] | None = None) -> None:
    """Train (or resume), then write the 16-bit checkpoint and its model card to ``--out``."""
    args = _parse(argv)
    command = shlex.join(["python", "-m", "checkpoints.train", *(sys.argv[1:] if argv is None else argv)])
    if args.evaluate_only:
        reevaluate(args)
        return
    torch.manual_seed(args.seed)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    train, val = prepare(args.work_dir)
    config = GPTConfig(
        n_positions=args.context, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
        resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
    )  # fmt: skip
    model = GPT(config)
    opt = _optimizer(model, args)
    step = load_state(model, opt, args.work_dir)
    print(f"{model.num_parameters() / 1e6:.2f}M parameters; train {len(train)} tokens, held-out {len(val)} "
          f"({', '.join(HELD_OUT)}); starting at step {step}/{args.steps}", flush=True)  # fmt: skip
    model.train()
    t0, seen, losses = time.perf_counter(), 0, []
    while step < args.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = batch(train, step, args)
        torch.manual_seed(args.seed + step)  # dropout masks depend on the step only, so resuming is exact
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, seen = step + 1, seen + x.numel()
        losses.append(loss.item())
        if step % args.log_every == 0:
            elapsed = time.perf_counter() - t0
            print(f"step {step}/{args.steps} loss {np.mean(losses[-args.log_every:]):.4f} "
                  f"lr {lr_at(step - 1, args):.2e} {seen / elapsed:.0f} tok/s {elapsed / 60:.1f} min",
                  flush=True)  # fmt: skip
        if step % args.eval_every == 0 or step == args.steps:
            val_loss = heldout_loss(model, val, args.context, args.eval_windows, bf16=True)
            print(f"step {step} held-out loss {val_loss:.4f} (first {args.eval_windows} windows)", flush=True)
            save_state(model, opt, step, args.work_dir)
            _keep_best(model, step, val_loss, args.work_dir)
    finish(model, args, train, val, command, train_loss=float(np.mean(losses[-50:])) if losses else None)


def evaluate_shipped(out: Path, train: np.ndarray, val: np.ndarray, held_out: str) -> dict[str, Any]:
    """Evaluate the checkpoint in ``out`` as it ships (16-bit weights, fp32 compute, eval mode); write the
    held-out works as plain text beside it (``heldout.txt``) and score that as ``gptgen score`` does."""
    from generate.score import score_ids

    shipped = load(out, dtype=torch.float32)
    val_loss = heldout_loss(shipped, val, shipped.config.n_positions, None, bf16=False)
    slice_ids = val[: min(SLICE_TOKENS, shipped.config.n_positions) + 1].astype(np.int64)
    with torch.no_grad():
        logits = shipped(torch.from_numpy(slice_ids[None, :-1]))
        slice_loss = F.cross_entropy(logits[0], torch.from_numpy(slice_ids[1:])).item()
    (out / HELD_OUT_FILE).write_text(held_out, encoding="utf-8")
    score = score_ids(shipped, load_tokenizer().encode_ordinary(held_out))
    return {
        "held_out_loss": val_loss,
        "held_out_perplexity": math.exp(val_loss),
        "unigram_held_out_loss": unigram_loss(train, val, shipped.config.vocab_size),
        "held_out_slice": {"token_ids": slice_ids.tolist(), "loss": slice_loss},
        "held_out_text_score": {
            "file": HELD_OUT_FILE,
            **{k: getattr(score, k) for k in ("tokens", "mean_nll", "perplexity", "window", "stride")},
        },
        "parameters": shipped.num_parameters(),
    }


def write_facts(out: Path, facts: dict[str, Any]) -> None:
    """Write ``training.json`` and the model card from the same facts, and print the headline figures."""
    (out / "training.json").write_text(json.dumps(facts, indent=1) + "\n")
    write_card(out, facts)
    print(f"held-out loss {facts['held_out_loss']:.4f} (perplexity {facts['held_out_perplexity']:.1f}), "
          f"unigram {facts['unigram_held_out_loss']:.4f}; wrote {out}", flush=True)  # fmt: skip


def finish(
    model: GPT,
    args: argparse.Namespace,
    train: np.ndarray,
    val: np.ndarray,
    command: str,
    train_loss: float | None,
) -> None:
    """Save the best weights in 16 bits, evaluate what was saved (fp32 compute), and write the model card."""
    best = json.loads((args.work_dir / "best.json").read_text())
    model.load_state_dict(load_file(str(args.work_dir / "best.safetensors")))
    save(model, args.out, dtype=torch.float16)
    facts = {
        "corpus": PACKAGE,
        "held_out_works": list(HELD_OUT),
        "train_tokens": len(train),
        "held_out_tokens": len(val),
        "steps": args.steps,
        "best_step": best["step"],
        "tokens_seen": args.steps * args.batch_size * args.context,
        "final_train_loss": train_loss,
        **evaluate_shipped(args.out, train, val, held_out_text(args.work_dir)),
        "command": command,
    }
    write_facts(args.out, facts)


def reevaluate(args: argparse.Namespace) -> None:
    """Recompute the evaluation figures of an already shipped checkpoint, keeping its training facts."""
    train, val = prepare(args.work_dir)
    facts = json.loads((args.out / "training.json").read_text())
    facts.update(evaluate_shipped(args.out, train, val, held_out_text(args.work_dir)))
    write_facts(args.out, facts)


if __name__ == "__main__":
    main()
