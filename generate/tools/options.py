"""What the commands share in their options: the parser, the model's options, and loading the model they name.

Only the standard library is imported at module level (see :mod:`generate.tools.cli`); the model code is
imported inside :func:`load_generator`.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from generate.api import Generator

DEFAULT_CHECKPOINT = "shakespeare"  # generate.api.DEFAULT_CHECKPOINT, repeated so --help needs no torch
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


class CommandParser(argparse.ArgumentParser):
    """The commands' parser: a usage error is one line on stderr and exit 2."""

    def error(self, message: str) -> NoReturn:  # one line, exit 2, as for every usage error
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def argv_text(text: str) -> str:
    """A command-line argument as UTF-8. Python decodes arguments with the locale's encoding: in a C locale
    without UTF-8 mode (``PYTHONUTF8=0``) that is ASCII, so UTF-8 bytes arrive as lone surrogates; they are
    decoded as UTF-8 here. Bytes that are not UTF-8 stay as surrogates, for the caller to refuse."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return os.fsencode(text).decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            pass
    return text


def unescape(text: str) -> str:
    r"""Turn the escapes ``\n``, ``\t``, ``\r`` and ``\\`` in argument ``text`` (:func:`argv_text`) into their
    characters.

    Any other backslash is kept as it is, so ``--stop '\n\n'`` means two newlines, as a shell cannot
    easily type them.
    """
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], argv_text(text))


def add_checkpoint_option(p: argparse.ArgumentParser) -> None:
    """``--checkpoint`` / ``-c``: which model (every command that runs one)."""
    p.add_argument(
        "--checkpoint",
        "-c",
        default=DEFAULT_CHECKPOINT,
        help=f"directory, .safetensors file, shipped name or hub id (default {DEFAULT_CHECKPOINT})",
    )


def add_model_options(p: argparse.ArgumentParser, dtype_help: str) -> None:
    """``--config``, ``--device``, ``--dtype`` and ``--group-size``: how the model is loaded (by generate
    and serve)."""
    p.add_argument(
        "--config",
        metavar="CONFIG",
        help="the model's config.json, or a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2), "
        "for a .safetensors file with no config.json beside it (default: the checkpoint's own)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or mps")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "int8", "int8-body", "int4", "int4-body"],
        help=dtype_help,
    )
    p.add_argument(
        "--group-size",
        type=int,
        choices=[32, 64, 128],
        help="int4's weights per scale and zero (default 32); only with --dtype int4 or int4-body",
    )


def check_model_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse a ``--group-size`` without an int4 dtype, and a ``--device`` that is unknown, absent or cannot
    compute in ``--dtype``: usage errors, before anything loads (this imports torch)."""
    if args.group_size is not None and not args.dtype.startswith("int4"):
        parser.error(f"--group-size applies to --dtype int4 or int4-body only, not {args.dtype}")
    from generate.tools.runner import import_holding_signals

    import_holding_signals("checkpoints")
    from checkpoints import QUANT_MODES, resolve_device, resolve_dtype

    try:
        resolve_device(args.device, resolve_dtype("bfloat16" if args.dtype in QUANT_MODES else args.dtype))
    except ValueError as e:
        parser.error(str(e))


def add_draft_option(p: argparse.ArgumentParser) -> None:
    """``--draft``: speculative decoding (generate and serve)."""
    p.add_argument(
        "--draft",
        metavar="DRAFT",
        help="speculative decoding: 'ngram' (prompt lookup) or a draft checkpoint sharing the tokenizer; "
        "the same output as without it",
    )


def load_generator(args: argparse.Namespace, slots: int | None = None) -> Generator:
    """Load the model the options of :func:`add_model_options` (and ``--checkpoint``, ``--compile``,
    ``--deterministic`` where the command has them) name, for an engine of ``slots`` rows (default 8);
    compile progress goes to the log."""
    from generate.api import DEFAULT_SLOTS, load

    deterministic, draft = getattr(args, "deterministic", False), getattr(args, "draft", None)
    return load(args.checkpoint, config=args.config, device=args.device, dtype=args.dtype,
                group_size=args.group_size, compile=args.compile, slots=slots or DEFAULT_SLOTS,
                deterministic=deterministic, draft=draft)  # fmt: skip
