"""The ``gptgen score`` command: measure a model on a text.

Like ``generate``, only the standard library is imported at module level; torch and the model are imported
once the options are read (with Ctrl-C held during torch's import, see
:func:`generate.tools.runner.import_holding_signals`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from generate.tools.cli import read_text, stdin_text
from generate.tools.command_base import add_common_options, clear_progress, progress_bar, run_parsed
from generate.tools.options import CommandParser, check_model_options, load_generator
from generate.tools.runner import import_holding_signals

SCORE_BATCH_SIZE = 4  # generate.score.DEFAULT_BATCH_SIZE, repeated so --help needs no torch

SCORE_EXAMPLES = r"""examples:
  gptgen score checkpoints/shakespeare/heldout.txt         # the shipped model's held-out text (its card)
  cat notes.txt | gptgen score -c path/to/checkpoint --json
  gptgen score book.txt --stride 128 --dtype bfloat16"""


def build_score_parser() -> argparse.ArgumentParser:
    """The ``gptgen score`` command's argument parser."""
    p = CommandParser(
        prog="gptgen score",
        description="Score a text under a model: tokens scored, mean negative log-likelihood (nats/token) "
        "and perplexity. Windows of the model's n_positions tokens advance by --stride; every token after "
        "the first is scored once, with at least n_positions - stride tokens of context where the text has "
        "them.",
        epilog=SCORE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", nargs="?", default="-", help="UTF-8 text file ('-' or absent: standard input)")
    add_common_options(p)
    p.add_argument("--stride", type=int, help="tokens each window's end advances (default half the window)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=SCORE_BATCH_SIZE,
        help=f"windows computed together (default {SCORE_BATCH_SIZE}; fewer need less memory)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: the figures, window, stride, token_ids and token_logprobs",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows on a terminal only)")
    return p


def _score(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if sys.stdout is None:  # started with standard output closed (`>&-`): say so before the work
        raise OSError("standard output is closed; redirect it to a file instead")
    check_model_options(args, parser)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.stride is not None and args.stride < 1:
        parser.error(f"--stride must be >= 1, got {args.stride}")
    if args.file == "-":
        text = stdin_text(parser, "no text: give a file, or pipe the text to standard input")
    else:
        text = read_text(args.file, "file")
    import_holding_signals("generate.api")
    gen = load_generator(args)
    if args.stride is not None and args.stride >= (window := gen.model.config.n_positions):
        parser.error(f"--stride must be below the model's window of {window} tokens, got {args.stride}")
    start = time.perf_counter()
    progress = None if args.no_progress else progress_bar(start, "scoring", "tokens")
    score = gen.score(text, stride=args.stride, batch_size=args.batch_size, progress=progress)
    seconds = time.perf_counter() - start
    clear_progress()
    if args.json:
        record = {"file": args.file, **score.to_dict(), "seconds": round(seconds, 3)}
        if math.isinf(score.perplexity):
            record["perplexity"] = None  # past a float's range (mean NLL > 709); JSON has no infinity
        sys.stdout.write(json.dumps(record) + "\n")
        return
    whole = score.window == score.tokens + 1  # (one window: the text fits it; no stride)
    windows = "one, the whole text" if whole else f"{score.window} tokens, stride {score.stride}"
    sys.stdout.write(
        f"tokens      {score.tokens:,}\n"
        f"mean NLL    {score.mean_nll:.4f} nats/token\n"
        f"perplexity  {score.perplexity:.2f}\n"
        f"windows     {windows}; {seconds:.1f} s "
        f"({score.tokens / seconds:,.0f} tokens/s)\n"
    )


def score_main(argv: list[str] | None = None) -> int:
    """Run ``gptgen score``; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    advice = "use a smaller --batch-size (windows at once) or a smaller --dtype"
    return run_parsed(_score, build_score_parser(), argv, advice)
