"""The ``gptgen batch`` command: generate for a file of prompts, locally or on Ray.

Like ``generate``, only the standard library is imported at module level; torch, the model and Ray are
imported once the options are read (with Ctrl-C held during torch's import, see
:func:`generate.tools.runner.import_holding_signals`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from generate.tools.command_base import add_common_options, clear_progress, progress_bar, run_parsed
from generate.tools.options import CommandParser, check_model_options, load_generator
from generate.tools.runner import import_holding_signals

if TYPE_CHECKING:
    from generate.tools.batch import Defaults

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
    add_common_options(p)
    p.add_argument("--max-new-tokens", "-n", type=int, default=100, help="for rows without their own (100)")
    p.add_argument("--temperature", "-t", type=float, default=0.8, help="for rows without their own (0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="for rows without their own (0.95)")
    p.add_argument("--seed", type=int, help="for rows without their own (default: none, not reproducible)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="for rows without their own")
    p.add_argument("--batch-size", type=int, default=16, help="rows generated together (slots; default 16)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run on Ray: a cluster's address, or none to start a local cluster")  # fmt: skip
    p.add_argument("--workers", type=int, help="with --ray: model replicas (actors; default 2)")
    p.add_argument("--cpus-per-worker", type=int, help="with --ray: CPUs (threads) per worker (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows on a terminal only)")
    return p


def _batch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    check_model_options(args, parser)
    if args.ray is None and (args.workers is not None or args.cpus_per_worker is not None):
        parser.error("--workers and --cpus-per-worker apply with --ray only")
    args.workers = 2 if args.workers is None else args.workers
    args.cpus_per_worker = 1 if args.cpus_per_worker is None else args.cpus_per_worker
    for name in ("batch_size", "workers", "cpus_per_worker"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    import_holding_signals("generate.tools.batch")
    try:
        defaults = _defaults(args)
    except ValueError as e:  # (a bad option value: a usage error, as in the other commands)
        parser.error(str(e))
    start = time.perf_counter()
    if args.ray is not None:
        ran, skipped = _run_on_ray(args, defaults, start)
        where = "on Ray"
    else:
        ran, skipped = _run_locally(args, defaults, start)
        where = "locally"
    clear_progress()
    seconds = time.perf_counter() - start
    print(
        f"wrote {args.output}: {ran:,} rows ({skipped:,} already there) in {seconds:.1f} s {where} "
        f"({ran / seconds:,.1f} rows/s)",
        file=sys.stderr,
    )


def _defaults(args: argparse.Namespace) -> Defaults:
    """The options' values for rows without their own, checked here rather than in every row."""
    from generate.engine.request import check_max_new_tokens, check_seed, check_stop
    from generate.engine.sampling import SamplingParams
    from generate.tools.batch import Defaults
    from generate.tools.options import unescape

    defaults = Defaults(
        max_new_tokens=check_max_new_tokens(args.max_new_tokens),
        temperature=args.temperature,
        top_p=args.top_p,
        seed=check_seed(args.seed),
        stop=check_stop([unescape(s) for s in args.stop]),
    )
    SamplingParams(temperature=args.temperature, top_p=args.top_p)  # refused here, not in every row
    return defaults


def _run_on_ray(args: argparse.Namespace, defaults: Defaults, start: float) -> tuple[int, int]:
    """Run the file on Ray; returns the rows run and the rows skipped."""
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
        return run_ray(
            args.input,
            args.output,
            defaults,
            load_options,
            address=args.ray or None,
            workers=args.workers,
            cpus_per_worker=args.cpus_per_worker,
            slots=args.batch_size,
            progress=None if args.no_progress else progress_bar(start, "generating", "rows", stderr),
        )


def _run_locally(args: argparse.Namespace, defaults: Defaults, start: float) -> tuple[int, int]:
    """Run the file in this process; returns the rows run and the rows skipped."""
    from generate.tools.batch import run_file

    gen = load_generator(args, slots=args.batch_size)
    show = None if args.no_progress else progress_bar(start, "generating", "rows")
    return run_file(
        gen,
        args.input,
        args.output,
        defaults,
        slots=args.batch_size,
        progress=None if show is None else lambda done, total, tokens: show(done, total),
    )


def batch_main(argv: list[str] | None = None) -> int:
    """Run ``gptgen batch``; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    advice = "use a smaller --batch-size or --max-new-tokens, or a smaller --dtype"
    return run_parsed(_batch, build_batch_parser(), argv, advice)
