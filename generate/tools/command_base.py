"""What the ``gptgen score``, ``gptgen attention`` and ``gptgen batch`` commands share: the model's options,
how a command runs, and the progress bar.

Only the standard library is imported at module level (see :mod:`generate.tools.cli`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TextIO

from generate.tools.options import add_checkpoint_option, add_model_options
from generate.tools.runner import run_command

DTYPE_HELP = "weights and compute (default float32); int8 and int4 weights compute in bf16"

_progress_shown = False


def add_common_options(p: argparse.ArgumentParser) -> None:
    """Add the checkpoint and model options these commands share (no --compile)."""
    add_checkpoint_option(p)
    add_model_options(p, dtype_help=DTYPE_HELP)
    p.set_defaults(compile=False)


def run_parsed(
    main: Callable[[argparse.Namespace, argparse.ArgumentParser], None],
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    memory_advice: str,
) -> int:
    """Run ``main`` on ``argv`` read by ``parser``, with the commands' endings (see
    :func:`generate.tools.runner.run_command`); returns the exit status."""

    def body() -> None:
        main(parser.parse_args(argv), parser)

    return run_command(parser.prog, body, memory_advice=memory_advice, on_stop=clear_progress)


def progress_bar(
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


def clear_progress() -> None:
    """Erase the progress bar's line on stderr, if one was shown."""
    global _progress_shown
    if _progress_shown and sys.stderr is not None:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()
        _progress_shown = False
