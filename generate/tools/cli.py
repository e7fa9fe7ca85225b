"""The ``generate`` command: prompt in, completion out (streamed by default).

Only the standard library is imported at module level: torch and the model code are imported inside
:func:`main`, under its Ctrl-C handling, so an interrupt during the ~2 s of startup exits 130 quietly.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, BinaryIO, NoReturn

if TYPE_CHECKING:
    from generate.api import Generator

DEFAULT_CHECKPOINT = "shakespeare"  # generate.api.DEFAULT_CHECKPOINT, repeated so --help needs no torch
MAX_BATCH_SIZE = 65_536  # far beyond any memory: each row holds ~2.4 MB of vocabulary-sized state alone
# The most a prompts file or standard input may hold: /dev/zero or an endless pipe ends in an error, not in
# memory running out. 64 MiB is about 15 million tokens of English, far past any window.
MAX_INPUT_BYTES = 64 * 2**20
SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty")  # fmt: skip
DESCRIPTION = """\
Continue a prompt with a GPT-2-family model. The prompt is read from standard
input when it is '-' or absent. The completion (prompt excluded) is streamed
to standard output."""
EXAMPLES = r"""examples:
  generate 'To be, or not to be' --seed 1
  echo 'Once upon a time' | generate --json -n 30
  generate --prompts-file prompts.txt --temperature 0 --max-new-tokens 20
  generate 'Hello' --stop '\n\n' --num-samples 3 --json"""
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


class CommandParser(argparse.ArgumentParser):
    """The commands' parser: a usage error is one line on stderr and exit 2."""

    def error(self, message: str) -> NoReturn:  # one line, exit 2, as for every usage error
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Output:
    """Standard output that remembers whether its last line is unfinished, so Ctrl-C can end just that."""

    def __init__(self) -> None:
        self.partial = False

    def write(self, text: str) -> None:
        if text:
            partial = not text.endswith("\n")
            # Marked before the write too: a Ctrl-C that lands just after the flush (before the line after
            # it runs) must still end the line it left open.
            self.partial = self.partial or partial
            sys.stdout.write(text)
            sys.stdout.flush()
            self.partial = partial


def unescape(text: str) -> str:
    r"""Turn the escapes ``\n``, ``\t``, ``\r`` and ``\\`` in ``text`` into their characters.

    Any other backslash is kept as it is, so ``--stop '\n\n'`` means two newlines, as a shell cannot
    easily type them.
    """
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text)


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
    """Refuse a ``--group-size`` without an int4 dtype (a usage error)."""
    if args.group_size is not None and not args.dtype.startswith("int4"):
        parser.error(f"--group-size applies to --dtype int4 or int4-body only, not {args.dtype}")


def import_holding_signals(name: str) -> None:
    """Import module ``name`` with Ctrl-C (and SIGTERM, where Python handles it) held back until it is done.

    torch imports numpy and treats any failure there as "numpy is missing", so an interrupt that lands in
    that ~0.3 s was lost (the command then ran to its end, exit 0), left numpy half-imported ("cannot load
    module more than once"), or aborted the process from C++. Here the signal is only recorded during the
    import and handed to the handler that was in place once it ends. An ignored or default-action signal
    (SIG_IGN, SIG_DFL) and calls outside the main thread are left alone.
    """
    if name in sys.modules:
        return
    import importlib
    import signal
    import threading

    caught: list[int] = []
    held = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if callable(handler):
                held[signum] = handler
                signal.signal(signum, lambda s, _frame: caught.append(s))
    try:
        importlib.import_module(name)
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
    for signum in dict.fromkeys(caught):
        held[signum](signum, None)  # default_int_handler raises KeyboardInterrupt here


def load_generator(args: argparse.Namespace, slots: int | None = None) -> Generator:
    """Load the model the options of :func:`add_model_options` (and ``--checkpoint``, ``--compile``,
    ``--deterministic`` where the command has them) name, for an engine of ``slots`` rows (default 8);
    compile progress goes to the log."""
    from generate.api import DEFAULT_SLOTS, load

    deterministic, draft = getattr(args, "deterministic", False), getattr(args, "draft", None)
    return load(args.checkpoint, config=args.config, device=args.device, dtype=args.dtype,
                group_size=args.group_size, compile=args.compile, slots=slots or DEFAULT_SLOTS,
                deterministic=deterministic, draft=draft)  # fmt: skip


def add_draft_option(p: argparse.ArgumentParser) -> None:
    """``--draft``: speculative decoding (generate and serve)."""
    p.add_argument(
        "--draft",
        metavar="DRAFT",
        help="speculative decoding: 'ngram' (prompt lookup) or a draft checkpoint sharing the tokenizer; "
        "the same output as without it",
    )


def build_parser(prog: str = "generate") -> argparse.ArgumentParser:
    """The command's argument parser (``prog``: its name in messages, ``gptgen generate`` as a subcommand)."""
    p = CommandParser(prog=prog, description=DESCRIPTION, epilog=EXAMPLES,
                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("prompt", nargs="?", default="-", help="text to continue ('-' or absent: read stdin)")
    p.add_argument(
        "--prompts-file", metavar="FILE", help="one prompt per line (blank lines skipped), run as batches"
    )
    add_checkpoint_option(p)
    add_model_options(
        p,
        dtype_help="weights and compute: float32 (default), bfloat16, float16, or int8 or int4 weights with "
        "bf16 compute (-body: output head in bf16)",
    )
    add_draft_option(p)
    p.add_argument(
        "--max-new-tokens", "-n", type=int, default=100, help="tokens to generate at most (default 100)"
    )
    p.add_argument("--temperature", "-t", type=float, default=0.8, help="0 for greedy (default 0.8)")
    p.add_argument(
        "--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all (default)"
    )
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass in (0, 1] (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 disables (default)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]; 0 disables (default)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]; 0 disables (default)")
    p.add_argument("--seed", type=int, help="make sampling reproducible (0..2**64-1); sample k uses seed + k")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        type=unescape,
        metavar="TEXT",
        help=r"stop when TEXT is generated (not printed); repeatable. \n, \t, \r and \\ in TEXT mean a "
        r"newline, tab, carriage return and backslash; any other backslash is kept as is",
    )
    p.add_argument("--num-samples", type=int, default=1, help="completions per prompt (default 1)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts run together at most (default 8)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per completion: text, token_ids, finish_reason, timing",
    )
    p.add_argument(
        "--logprobs", action="store_true", help="with --json, include each token's log-probability"
    )
    p.add_argument("--no-stream", action="store_true", help="print the completion only when it is complete")
    p.add_argument(
        "--compile",
        action="store_true",
        help="run the decode step compiled: a minute or more to compile the first time for each checkpoint, "
        "dtype and --batch-size, then kept on disk and loaded in seconds; pays off for long or many "
        "generations",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="run every prompt in an engine of --batch-size rows, so that a prompt gives the same bits alone "
        "or in a batch (a lone prompt then takes 1.5-2.7x the time a token)",
    )
    return p  # fmt: skip


def _argument_prompt(prompt: str, parser: argparse.ArgumentParser) -> str:
    """The prompt argument, refused if the OS handed over bytes that are not UTF-8 (as lone surrogates)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = len(prompt[: e.start].encode("utf-8"))
        parser.error(f"the prompt argument is not valid UTF-8 (byte {byte}); convert it to UTF-8")
    return prompt


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
            raise ValueError(f"prompts file {args.prompts_file} has no prompts (only blank lines)")
        return prompts
    if args.prompt != "-":
        return [(None, _argument_prompt(args.prompt, parser))]
    text = stdin_text(parser, "no prompt: give one as an argument, or pipe it to standard input")
    # One line ending, as `echo` or a Windows editor writes it, ends the prompt; it is not part of it.
    return [(None, text[:-2] if text.endswith("\r\n") else text.removesuffix("\n"))]


def _check_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse bad options as usage errors (exit 2) before anything is loaded."""
    for name in ("num_samples", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch_size > MAX_BATCH_SIZE:
        parser.error(f"--batch-size must be <= {MAX_BATCH_SIZE}, got {args.batch_size}; use a smaller batch")
    if args.max_new_tokens < 0:
        parser.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if any(not s for s in args.stop):
        parser.error("--stop needs a non-empty string")
    if args.logprobs and not args.json:
        parser.error("--logprobs only shows in JSON output; add --json")
    # These imports load torch (seconds); main() calls this inside its Ctrl-C handling.
    from checkpoints import QUANT_MODES, resolve_device, resolve_dtype
    from generate.engine.request import check_seed
    from generate.engine.sampling import SamplingParams

    check_model_options(args, parser)
    try:
        SamplingParams(**{name: getattr(args, name) for name in SAMPLING_OPTIONS})
        resolve_device(args.device, resolve_dtype("bfloat16" if args.dtype in QUANT_MODES else args.dtype))
    except ValueError as e:
        parser.error(str(e))
    if args.seed is not None:
        last = args.seed + args.num_samples - 1  # sample k uses seed + k
        try:
            check_seed(args.seed)
        except ValueError:
            parser.error(f"--seed {args.seed} is out of range; use a seed in 0..2**64-1")
        try:
            check_seed(last)
        except ValueError:
            parser.error(
                f"--seed {args.seed} with --num-samples {args.num_samples} needs seeds up to {last}, beyond "
                "2**64-1; use a smaller --seed or fewer samples"
            )


def _check_prompts(gen: Generator, prompts: list[tuple[int | None, str]], prompts_file: str | None) -> None:
    """Check every prompt against the model before the first batch runs; name a bad one by its file line."""
    from generate.engine.request import check_prompt

    config = gen.model.config
    for line, prompt in prompts:
        try:
            check_prompt(gen.encode(prompt), config.vocab_size, config.n_positions)
        except ValueError as e:
            raise ValueError(str(e) if line is None else f"{prompts_file} line {line}: {e}") from None


def _rows(prompts: list[str], num_samples: int) -> Iterator[tuple[str, int]]:
    """(prompt, sample index) for every completion, made as needed (num_samples may be huge)."""
    for prompt in prompts:
        for k in range(num_samples):
            yield prompt, k


def _run(gen: Generator, prompts: list[str], args: argparse.Namespace, out: _Output) -> None:
    options = {name: getattr(args, name) for name in SAMPLING_OPTIONS}
    options.update(max_new_tokens=args.max_new_tokens, stop=args.stop, logprobs=args.logprobs)
    total = len(prompts) * args.num_samples
    if total == 1 and not args.json and not args.no_stream:
        for piece in gen.stream(prompts[0], seed=args.seed, **options):
            out.write(piece)
        out.write("\n")
        return
    rows, size = _rows(prompts, args.num_samples), min(args.batch_size, total)
    while batch := list(itertools.islice(rows, size)):
        seeds = [None if args.seed is None else args.seed + k for _, k in batch]
        t0 = time.perf_counter()
        outs = gen.generate([p for p, _ in batch], seed=seeds, **options)
        seconds = time.perf_counter() - t0
        new_tokens = sum(len(o.token_ids) for o in outs)
        for (prompt, k), completion in zip(batch, outs, strict=True):
            if args.json:
                record = {"prompt": prompt, "sample": k, "text": completion.text,
                          "token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
                          "prompt_tokens": completion.prompt_tokens,
                          "timing": {"batch_seconds": round(seconds, 4), "batch_size": len(batch),
                                     "batch_tokens_per_second": round(new_tokens / seconds, 2)}}  # fmt: skip
                if args.logprobs:
                    record["logprobs"] = completion.logprobs
                if gen.speculation is not None:
                    record["speculation"] = gen.speculation  # (every call's so far)
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            else:
                out.write(completion.text + ("\n\n" if total > 1 else "\n"))


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser, out: _Output) -> None:
    import_holding_signals(
        "generate.api"
    )  # torch, numpy, tiktoken, safetensors: the options' checks need them
    _check_options(args, parser)
    prompts = _read_prompts(args, parser)
    if args.compile:  # compiling takes tens of seconds: say what is happening, on stderr
        import logging

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("generate: %(message)s"))
        logging.getLogger("gptgen").addHandler(handler)
        logging.getLogger("gptgen").setLevel(logging.INFO)
    gen = load_generator(args, slots=args.batch_size)
    if args.compile and len(prompts) * args.num_samples > 1:
        gen.deterministic = True  # every batch at --batch-size rows: one compiled step, even for the last
    _check_prompts(gen, prompts, args.prompts_file)
    _run(gen, [prompt for _, prompt in prompts], args, out)


GENERATE_MEMORY_ADVICE = (
    "use a smaller --batch-size or --max-new-tokens, a shorter prompt, or a smaller --dtype"
)


def main(argv: list[str] | None = None, prog: str = "generate") -> int:
    """Run the command; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    out = _Output()
    if sys.stdout is None:  # started with standard output closed (`>&-`): nowhere to write the text
        print(f"{prog}: error: standard output is closed; redirect it to a file instead", file=sys.stderr)
        return 1

    def end_line() -> None:  # end a streamed line; a JSON or finished line is left whole
        if out.partial:
            sys.stdout.write("\n")
            sys.stdout.flush()

    def body() -> None:
        parser = build_parser(prog)
        _generate(parser.parse_args(argv), parser, out)

    return run_command(prog, body, memory_advice=GENERATE_MEMORY_ADVICE, on_stop=end_line)


def run_command(
    prog: str, body: Callable[[], None], *, memory_advice: str, on_stop: Callable[[], None] | None = None
) -> int:
    """Run a command's body with the commands' endings: 0 when it returns; 130 on Ctrl-C; 0, quietly, when
    the reader of standard output went away (``| head``); 1 with one line on stderr for a documented error
    (out of memory said with ``memory_advice``). ``on_stop`` runs first on Ctrl-C or an error. A usage
    error leaves as argparse's ``SystemExit(2)``."""
    try:
        body()
    except KeyboardInterrupt:
        if on_stop is not None:
            on_stop()
        return 130
    except BrokenPipeError:
        sys.stderr.close()
        return 0
    # CheckpointError is a ValueError and GenerationError a RuntimeError; naming them would import torch.
    except (ValueError, MemoryError, RuntimeError, OSError, ImportError) as e:
        if on_stop is not None:
            on_stop()
        print(f"{prog}: error: {error_message(e, memory_advice)}", file=sys.stderr)
        return 1
    return 0


def error_message(error: BaseException, memory_advice: str = GENERATE_MEMORY_ADVICE) -> str:
    """One line for the error, long paths shortened. The allocator's failures (a ``RuntimeError`` such as
    ``[enforce fail at alloc_cpu.cpp...]``, or a MemoryError made from one) end with ``memory_advice``:
    what to change in this command."""
    from checkpoints.errors import elide

    allocator = error.__cause__ if isinstance(error, MemoryError) else error
    if isinstance(allocator, RuntimeError):
        from generate.engine.memory import out_of_memory

        error = out_of_memory(allocator, memory_advice) or error
    text = str(error) or ("out of memory" if isinstance(error, MemoryError) else type(error).__name__)
    return elide(text.replace("\n", " "))  # one line, with any huge path shortened


if __name__ == "__main__":
    sys.exit(main())
