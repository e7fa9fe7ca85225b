"""The ``generate`` command: prompt in, completion out (streamed by default).

Only the standard library is imported at module level (and the command modules below, which import no more):
torch and the model code are imported inside :func:`main`, under its Ctrl-C handling, so an interrupt during
the ~2 s of startup exits 130 quietly.

This module reads the prompts and runs the command; its options are in :mod:`generate.tools.generate_options`,
the run and its printing in :mod:`generate.tools.generate_output`, and what every command shares in
:mod:`generate.tools.options` and :mod:`generate.tools.runner` (their names are importable from here too).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import BinaryIO

from generate.tools.generate_options import (
    DESCRIPTION,
    EXAMPLES,
    MAX_BATCH_SIZE,
    SAMPLING_OPTIONS,
    build_parser,
    check_options,
)
from generate.tools.generate_output import Output, check_prompts, run_generation
from generate.tools.options import (
    DEFAULT_CHECKPOINT,
    CommandParser,
    add_checkpoint_option,
    add_draft_option,
    add_model_options,
    argv_text,
    check_model_options,
    load_generator,
    unescape,
)
from generate.tools.runner import GENERATE_MEMORY_ADVICE, error_message, import_holding_signals, run_command

__all__ = [
    "DEFAULT_CHECKPOINT",
    "DESCRIPTION",
    "EXAMPLES",
    "GENERATE_MEMORY_ADVICE",
    "MAX_BATCH_SIZE",
    "MAX_INPUT_BYTES",
    "SAMPLING_OPTIONS",
    "CommandParser",
    "add_checkpoint_option",
    "add_draft_option",
    "add_model_options",
    "build_parser",
    "check_model_options",
    "error_message",
    "import_holding_signals",
    "load_generator",
    "main",
    "read_text",
    "run_command",
    "stdin_text",
    "unescape",
]

# The most a prompts file or standard input may hold: /dev/zero or an endless pipe ends in an error, not in
# memory running out. 64 MiB is about 15 million tokens of English, far past any window.
MAX_INPUT_BYTES = 64 * 2**20


def argument_text(text: str, parser: argparse.ArgumentParser, what: str = "prompt") -> str:
    """A text argument, refused if the OS handed over bytes that are not UTF-8 (as lone surrogates)."""
    text = argv_text(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = len(text[: e.start].encode("utf-8"))
        parser.error(f"the {what} argument is not valid UTF-8 (byte {byte}); convert it to UTF-8")
    return text


def _read_bounded(f: BinaryIO, what: str) -> bytes:
    data = f.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise ValueError(f"{what} holds more than {MAX_INPUT_BYTES:,} bytes; give a shorter input")
    return data


def read_text(path: str, what: str) -> str:
    """The UTF-8 text of file ``path`` (``-``: standard input), at most ``MAX_INPUT_BYTES``, without a
    byte-order mark. ``what`` names the file in errors (``"prompts file"``). Raises ValueError."""
    name = "standard input" if path == "-" else f"{what} {path}"
    try:
        if path == "-":
            if sys.stdin is None:
                raise ValueError("standard input is closed; give a file, or pipe the text in")
            data = _read_bounded(sys.stdin.buffer, name)
        else:
            with open(path, "rb") as f:
                data = _read_bounded(f, name)
    except OSError as e:
        raise ValueError(f"cannot read {name}: {e.strerror or e}") from e
    try:
        return data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark is not part of the text
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        where = f"line {line}, byte {e.start}"
        raise ValueError(f"{name} is not valid UTF-8 ({where}); convert it to UTF-8") from e


def stdin_text(parser: argparse.ArgumentParser, missing: str) -> str:
    """The text piped to standard input (:func:`read_text`); the usage error ``missing`` when none is (a
    terminal, or closed)."""
    if sys.stdin is None or sys.stdin.isatty():
        parser.error(missing)
    return read_text("-", "standard input")


def _read_file(path: str) -> list[tuple[int, str]]:
    """The non-blank lines of a prompts file with their 1-based line numbers (blank lines counted)."""
    lines = (line.removesuffix("\r") for line in read_text(path, "prompts file").split("\n"))
    return [(number, line) for number, line in enumerate(lines, 1) if line.strip()]


def _read_prompts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[tuple[int | None, str]]:
    """(line number in the prompts file or None, prompt) for every prompt to run."""
    if args.prompts_file is not None:
        if args.prompt != "-":
            parser.error("give either a prompt or --prompts-file, not both")
        prompts = _read_file(args.prompts_file)
        if not prompts:
            name = "standard input" if args.prompts_file == "-" else f"prompts file {args.prompts_file}"
            raise ValueError(f"{name} has no prompts (only blank lines)")
        return prompts
    if args.prompt != "-":
        return [(None, argument_text(args.prompt, parser))]
    text = stdin_text(parser, "no prompt: give one as an argument, or pipe it to standard input")
    # One line ending, as `echo` or a Windows editor writes it, ends the prompt; it is not part of it.
    return [(None, text[:-2] if text.endswith("\r\n") else text.removesuffix("\n"))]


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser, out: Output) -> None:
    import_holding_signals(
        "generate.api"
    )  # torch, numpy, tiktoken, safetensors: the options' checks need them
    check_options(args, parser)
    prompts = _read_prompts(args, parser)
    if args.compile:  # compiling takes tens of seconds: say what is happening, on stderr
        import logging

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{parser.prog}: %(message)s"))
        logging.getLogger("gptgen").addHandler(handler)
        logging.getLogger("gptgen").setLevel(logging.INFO)
    gen = load_generator(args, slots=args.batch_size)
    if args.compile and len(prompts) * args.num_samples > 1:
        gen.deterministic = True  # every batch at --batch-size rows: one compiled step, even for the last
    check_prompts(gen, prompts, "standard input" if args.prompts_file == "-" else args.prompts_file)
    run_generation(gen, [prompt for _, prompt in prompts], args, out)


def main(argv: list[str] | None = None, prog: str = "generate") -> int:
    """Run the command; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    out = Output()
    if sys.stdout is None:  # started with standard output closed (`>&-`): nowhere to write the text
        print(f"{prog}: error: standard output is closed; redirect it to a file instead", file=sys.stderr)
        return 1

    def end_line() -> None:  # end a streamed line; a JSON or finished line is left whole
        if out.partial:
            with contextlib.suppress(OSError):  # (the error may be standard output's own: a full disk)
                sys.stdout.write("\n")
                sys.stdout.flush()

    def body() -> None:
        parser = build_parser(prog)
        _generate(parser.parse_args(argv), parser, out)

    return run_command(prog, body, memory_advice=GENERATE_MEMORY_ADVICE, on_stop=end_line)


if __name__ == "__main__":
    sys.exit(main())
