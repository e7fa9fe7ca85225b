"""The ``gptgen score`` and ``gptgen attention`` commands: measure a model on a text, and picture its
causal attention.

Like ``generate``, only the standard library is imported at module level; torch, the model and matplotlib
are imported once the options are read (with Ctrl-C held during torch's import, see
:func:`generate.tools.runner.import_holding_signals`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from generate.tools.cli import read_text, stdin_text
from generate.tools.options import (
    CommandParser,
    add_checkpoint_option,
    add_model_options,
    check_model_options,
    load_generator,
)
from generate.tools.runner import import_holding_signals, run_command

SCORE_BATCH_SIZE = 4  # generate.score.DEFAULT_BATCH_SIZE, repeated so --help needs no torch
MAX_MASK_TOKENS = 1024  # --mask loads no model, so no window bounds the text: this does
PICTURE_FORMATS = (".png", ".svg", ".pdf")
DTYPE_HELP = "weights and compute (default float32); int8 and int4 weights compute in bf16"


def _common(p: argparse.ArgumentParser) -> None:
    add_checkpoint_option(p)
    add_model_options(p, dtype_help=DTYPE_HELP)
    p.set_defaults(compile=False)


def _run(
    main: Callable[[argparse.Namespace, argparse.ArgumentParser], None],
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    memory_advice: str,
) -> int:
    def body() -> None:
        main(parser.parse_args(argv), parser)

    return run_command(parser.prog, body, memory_advice=memory_advice, on_stop=_clear_progress)


# --- gptgen score -------------------------------------------------------------------------------------------

SCORE_EXAMPLES = r"""examples:
  gptgen score checkpoints/shakespeare/heldout.txt         # the shipped model's held-out text (its card)
  cat notes.txt | gptgen score -c path/to/checkpoint --json
  gptgen score book.txt --stride 128 --dtype bfloat16"""

_progress_shown = False


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
    _common(p)
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


def _progress(
    start: float, verb: str, unit: str, stream: TextIO | None = None
) -> Callable[[int, int], None] | None:
    """A progress bar on ``stream`` (default stderr; a terminal only): how many ``unit`` are done, percent,
    speed."""
    out = stream if stream is not None else sys.stderr
    if out is None or not out.isatty():
        return None

    def show(done: int, total: int) -> None:
        global _progress_shown
        rate = done / max(time.perf_counter() - start, 1e-9)
        line = f"{verb}: {done:,}/{total:,} {unit} ({done / max(total, 1):.0%}), {rate:,.1f} {unit}/s"
        out.write("\r\x1b[K" + line)
        out.flush()
        _progress_shown = True

    return show


def _clear_progress() -> None:
    global _progress_shown
    if _progress_shown and sys.stderr is not None:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()
        _progress_shown = False


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
    start = time.perf_counter()
    progress = None if args.no_progress else _progress(start, "scoring", "tokens")
    score = gen.score(text, stride=args.stride, batch_size=args.batch_size, progress=progress)
    seconds = time.perf_counter() - start
    _clear_progress()
    if args.json:
        record = {"file": args.file, **score.to_dict(), "seconds": round(seconds, 3)}
        if math.isinf(score.perplexity):
            record["perplexity"] = None  # past a float's range (mean NLL > 709); JSON has no infinity
        sys.stdout.write(json.dumps(record) + "\n")
        return
    sys.stdout.write(
        f"tokens      {score.tokens:,}\n"
        f"mean NLL    {score.mean_nll:.4f} nats/token\n"
        f"perplexity  {score.perplexity:.2f}\n"
        f"windows     {score.window} tokens, stride {score.stride}; {seconds:.1f} s "
        f"({score.tokens / seconds:,.0f} tokens/s)\n"
    )


def score_main(argv: list[str] | None = None) -> int:
    """Run ``gptgen score``; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    advice = "use a smaller --batch-size (windows at once) or a smaller --dtype"
    return _run(_score, build_score_parser(), argv, advice)


# --- gptgen attention ---------------------------------------------------------------------------------------

ATTENTION_EXAMPLES = r"""examples:
  gptgen attention "To be, or not to be" -o heads.png              # layer 0, every head in a grid
  gptgen attention "To be, or not to be" -o head.png --layer 3 --head 1
  gptgen attention "To be, or not to be" -o mean.png --layer -1 --mean
  gptgen attention "To be, or not to be" -o mask.png --mask        # the causal mask itself"""


def build_attention_parser() -> argparse.ArgumentParser:
    """The ``gptgen attention`` command's argument parser."""
    p = CommandParser(
        prog="gptgen attention",
        description="Draw a model's causal attention over a text as a heatmap: queries down, keys across, "
        "the masked future hatched. One head (--layer and --head), one layer's heads as a grid (--layer "
        "alone), the layer's mean over heads (--mean), or the causal mask itself (--mask).",
        epilog=ATTENTION_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("text", nargs="?", default="-", help="the text ('-' or absent: standard input)")
    p.add_argument("--output", "-o", required=True, help="the picture to write: .png, .svg or .pdf")
    _common(p)
    p.add_argument("--layer", type=int, help="the layer, from 0 (default); negative counts from the last")
    p.add_argument("--head", type=int, help="one head of the layer, from 0 (default: all heads, a grid)")
    p.add_argument("--mean", action="store_true", help="the mean over the layer's heads")
    p.add_argument("--mask", action="store_true", help="draw the causal mask (0 and -inf), no model run")
    p.add_argument("--size", default=None, metavar="WxH", help="picture size in pixels, e.g. 1200x1000")
    return p


def _size(text: str | None, parser: argparse.ArgumentParser) -> tuple[int, int] | None:
    if text is None:
        return None
    match = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not match or not all(100 <= int(v) <= 10_000 for v in match.groups()):
        parser.error(f"--size {text!r} must be WIDTHxHEIGHT in pixels, each 100..10000, e.g. 1200x1000")
    return int(match.group(1)), int(match.group(2))


def _attention(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    check_model_options(args, parser)
    output = Path(args.output)
    if output.suffix.lower() not in PICTURE_FORMATS:
        parser.error(f"--output {args.output!r} must end in {', '.join(PICTURE_FORMATS)}")
    if args.head is not None and args.mean:
        parser.error("give --head or --mean, not both")
    if args.mask and (args.head is not None or args.mean or args.layer is not None):
        parser.error("--mask draws the mask alone; leave out --layer, --head and --mean")
    size = _size(args.size, parser)
    text = args.text
    if text == "-":
        missing = "no text: give it as an argument, or pipe the text to standard input"
        text = stdin_text(parser, missing).removesuffix("\n")
    from generate.tools.plot import require_matplotlib

    require_matplotlib()  # before any model is loaded
    import_holding_signals("generate.api")
    import torch

    if args.mask:
        from checkpoints import EOT_ID, load_tokenizer

        tokenizer = load_tokenizer()
        ids = tokenizer.encode_ordinary(text) or [EOT_ID]
        if len(ids) > MAX_MASK_TOKENS:
            raise ValueError(
                f"the text has {len(ids)} tokens; --mask draws at most {MAX_MASK_TOKENS}: shorten the text"
            )
        t = len(ids)
        weights = torch.triu(torch.ones(t, t), diagonal=1)
        titles = [f"causal mask over {t} tokens"]
        suptitle = "added to the scores before the softmax: 0 where a query may attend, -inf (the future) not"
    else:
        gen = load_generator(args)
        tokenizer, ids = gen.tokenizer, gen.encode(text)
        n_layer, n_head = gen.model.config.n_layer, gen.model.config.n_head
        layer = 0 if args.layer is None else args.layer
        if not -n_layer <= layer < n_layer:  # (options out of range: usage errors, exit 2)
            parser.error(f"--layer {layer} is out of range; this model has layers 0..{n_layer - 1}")
        if args.head is not None and not 0 <= args.head < n_head:
            parser.error(f"--head {args.head} is out of range; this model has heads 0..{n_head - 1}")
        layer %= n_layer
        maps = gen.attention(text, layer=layer)  # (n_head, T, T)
        if args.head is not None:
            weights, titles = maps[args.head], [f"layer {layer}, head {args.head}"]
        elif args.mean:
            weights, titles = maps.mean(0), [f"layer {layer}, mean of {n_head} heads"]
        else:
            weights, titles = maps, [f"head {h}" for h in range(n_head)]
        suptitle = None if args.head is not None or args.mean else f"layer {layer}: attention weights"
    from generate.tools.plot import attention_figure

    pieces = [tokenizer.decode([i]) for i in ids]
    figure = attention_figure(weights, pieces, titles=titles, suptitle=suptitle, size=size, mask=args.mask)
    _save(figure, output)
    print(f"wrote {output} ({len(ids)} tokens)", file=sys.stderr)


def _save(figure, output: Path) -> None:  # figure: a matplotlib Figure
    """Write the picture whole or not at all: drawn to a temporary file beside it, then renamed."""
    directory = output.parent
    if not directory.is_dir():
        raise ValueError(f"cannot write {output}: the folder {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", suffix=output.suffix, dir=directory)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as an ordinary new file (mkstemp makes it 0600)
    try:
        figure.savefig(tmp, format=output.suffix.lower()[1:])
        os.replace(tmp, output)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def attention_main(argv: list[str] | None = None) -> int:
    """Run ``gptgen attention``; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    return _run(_attention, build_attention_parser(), argv, "use a shorter text or a smaller --dtype")


# --- gptgen batch -------------------------------------------------------------------------------------------

BATCH_EXAMPLES = r"""examples:
  gptgen batch prompts.jsonl completions.jsonl -t 0 --max-new-tokens 50     # locally, resumable
  gptgen batch prompts.parquet out.parquet --seed 1
  gptgen batch prompts.jsonl out/ --ray                                      # a local Ray cluster
  gptgen batch prompts.jsonl /shared/out/ --ray 10.0.0.1:6379 --workers 8 --cpus-per-worker 2"""


def build_batch_parser() -> argparse.ArgumentParser:
    """The ``gptgen batch`` command's argument parser."""
    p = CommandParser(
        prog="gptgen batch",
        description="Generate for every row of a JSON Lines or Parquet file with a 'prompt' column (and "
        "optional per-row seed, max_new_tokens, temperature, top_p, stop). The output has every input field "
        "plus text, finish_reason, token_ids and error (null unless that row failed). Locally the output is "
        "one file of the input's format, and rows already in it are skipped (run again to resume); with "
        "--ray it is a folder of part files written by Ray Data.",
        epilog=BATCH_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", help="prompts: .jsonl (.json, .ndjson) or .parquet")
    p.add_argument("output", help="results in the same format (with --ray: a folder)")
    _common(p)
    p.add_argument("--max-new-tokens", "-n", type=int, default=100, help="for rows without their own (100)")
    p.add_argument("--temperature", "-t", type=float, default=0.8, help="for rows without their own (0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="for rows without their own (0.95)")
    p.add_argument("--seed", type=int, help="for rows without their own (default: none, not reproducible)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="for rows without their own")
    p.add_argument("--batch-size", type=int, default=16, help="rows generated together (slots; default 16)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run on Ray: a cluster's address, or none to start a local cluster")  # fmt: skip
    p.add_argument("--workers", type=int, default=2, help="with --ray: model replicas (actors; default 2)")
    p.add_argument("--cpus-per-worker", type=int, default=1, help="with --ray: CPUs (threads) per worker")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows on a terminal only)")
    return p


def _batch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    check_model_options(args, parser)
    for name in ("batch_size", "workers", "cpus_per_worker"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.ray is None and (args.workers != 2 or args.cpus_per_worker != 1):
        parser.error("--workers and --cpus-per-worker apply with --ray only")
    import_holding_signals("generate.tools.batch")
    from generate.engine.request import check_max_new_tokens, check_seed
    from generate.engine.sampling import SamplingParams
    from generate.tools.batch import Defaults
    from generate.tools.options import unescape

    defaults = Defaults(
        max_new_tokens=check_max_new_tokens(args.max_new_tokens),
        temperature=args.temperature,
        top_p=args.top_p,
        seed=check_seed(args.seed),
        stop=tuple(unescape(s) for s in args.stop),
    )
    SamplingParams(temperature=args.temperature, top_p=args.top_p)  # refused here, not in every row
    start = time.perf_counter()
    if args.ray is not None:
        from generate.tools.ray_batch import console_to_null, run_ray

        load_options = {
            "source": args.checkpoint,
            "config": args.config,
            "device": args.device,
            "dtype": args.dtype,
            "group_size": args.group_size,
        }
        # Ray's own console output (progress logs, tracebacks of a worker's failure, core-worker errors)
        # goes to its log files only: the command prints its progress and one line of result or error.
        with console_to_null() as stderr:
            ran, skipped = run_ray(
                args.input,
                args.output,
                defaults,
                load_options,
                address=args.ray or None,
                workers=args.workers,
                cpus_per_worker=args.cpus_per_worker,
                slots=args.batch_size,
                progress=None if args.no_progress else _progress(start, "generating", "rows", stderr),
            )
        where = "on Ray"
    else:
        from generate.tools.batch import run_file

        gen = load_generator(args, slots=args.batch_size)
        show = None if args.no_progress else _progress(start, "generating", "rows")
        ran, skipped = run_file(
            gen,
            args.input,
            args.output,
            defaults,
            slots=args.batch_size,
            progress=None if show is None else lambda done, total, tokens: show(done, total),
        )
        where = "locally"
    _clear_progress()
    seconds = time.perf_counter() - start
    print(
        f"wrote {args.output}: {ran:,} rows ({skipped:,} already there) in {seconds:.1f} s {where} "
        f"({ran / seconds:,.1f} rows/s)",
        file=sys.stderr,
    )


def batch_main(argv: list[str] | None = None) -> int:
    """Run ``gptgen batch``; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    advice = "use a smaller --batch-size or --max-new-tokens, or a smaller --dtype"
    return _run(_batch, build_batch_parser(), argv, advice)
