"""The ``generate`` command: prompt in, completion out (streamed by default)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import NoReturn

from checkpoints import CheckpointError, resolve_device, resolve_dtype
from generate.api import DEFAULT_CHECKPOINT, Generator, load
from generate.engine import GenerationError
from generate.sampling import SamplingParams

SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty")  # fmt: skip


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as for every usage error
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = _Parser(
        prog="generate",
        description="Continue a prompt with a GPT-2-family model. The prompt is read from standard input "
        "when it is '-' or absent. The completion (prompt excluded) is streamed to standard output.",
        epilog="Examples: generate 'To be, or not to be' --seed 1 | echo 'Once upon' | generate --json | "
        "generate --prompts-file prompts.txt --temperature 0 --max-new-tokens 20",
    )
    p.add_argument("prompt", nargs="?", default="-", help="text to continue ('-' or absent: read stdin)")
    p.add_argument(
        "--prompts-file", metavar="FILE", help="one prompt per line (blank lines skipped), run as batches"
    )
    p.add_argument(
        "--checkpoint",
        "-c",
        default=DEFAULT_CHECKPOINT,
        help=f"directory, .safetensors file, shipped name or hub id (default {DEFAULT_CHECKPOINT})",
    )
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "int8"],
        help="weights and compute: float32 (default), bfloat16, float16, or int8 weights with bf16 compute",
    )
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
    p.add_argument("--seed", type=int, help="make sampling reproducible; sample k uses seed + k")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when TEXT is generated (not printed); repeatable",
    )
    p.add_argument("--num-samples", type=int, default=1, help="completions per prompt (default 1)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts run together at most (default 16)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per completion: text, token_ids, finish_reason, timing",
    )
    p.add_argument(
        "--logprobs", action="store_true", help="with --json, include each token's log-probability"
    )
    p.add_argument("--no-stream", action="store_true", help="print the completion only when it is complete")
    return p  # fmt: skip


def _read_prompts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    if args.prompts_file is not None:
        if args.prompt != "-":
            parser.error("give either a prompt or --prompts-file, not both")
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                lines = [line.rstrip("\r\n") for line in f]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read prompts file {args.prompts_file}: {e}") from e
        return [line for line in lines if line.strip()]
    if args.prompt != "-":
        return [args.prompt]
    if sys.stdin is None or sys.stdin.isatty():
        parser.error("no prompt: give one as an argument, or pipe it to standard input")
    data = sys.stdin.buffer.read()
    try:
        return [data.decode("utf-8").removesuffix("\n")]
    except UnicodeDecodeError as e:
        raise ValueError(f"standard input is not valid UTF-8 (byte {e.start}); convert it to UTF-8") from e


def _check_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        SamplingParams(**{name: getattr(args, name) for name in SAMPLING_OPTIONS})
        resolve_device(args.device, resolve_dtype("bfloat16" if args.dtype == "int8" else args.dtype))
    except ValueError as e:
        parser.error(str(e))
    for name in ("num_samples", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_new_tokens < 0:
        parser.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if any(not s for s in args.stop):
        parser.error("--stop needs a non-empty string")


def _run(gen: Generator, prompts: list[str], args: argparse.Namespace) -> None:
    options = {name: getattr(args, name) for name in SAMPLING_OPTIONS}
    options.update(max_new_tokens=args.max_new_tokens, stop=args.stop, logprobs=args.logprobs)
    rows = [(p, k) for p in prompts for k in range(args.num_samples)]
    if len(rows) == 1 and not args.json and not args.no_stream:
        for piece in gen.stream(prompts[0], seed=args.seed, **options):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return
    for start in range(0, len(rows), args.batch_size):
        batch = rows[start : start + args.batch_size]
        seeds = [None if args.seed is None else args.seed + k for _, k in batch]
        t0 = time.perf_counter()
        outs = gen.generate([p for p, _ in batch], seed=seeds, batch_size=args.batch_size, **options)
        seconds = time.perf_counter() - t0
        new_tokens = sum(len(o.token_ids) for o in outs)
        for (prompt, k), out in zip(batch, outs, strict=True):
            if args.json:
                record = {"prompt": prompt, "sample": k, "text": out.text, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
                          "timing": {"batch_seconds": round(seconds, 4), "batch_size": len(batch),
                                     "batch_tokens_per_second": round(new_tokens / seconds, 2)}}  # fmt: skip
                if args.logprobs:
                    record["logprobs"] = out.logprobs
                print(json.dumps(record, ensure_ascii=False), flush=True)
            else:
                print(out.text + ("\n" if len(rows) > 1 else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_options(args, parser)
    try:
        prompts = _read_prompts(args, parser)
        if not prompts:
            raise ValueError(f"prompts file {args.prompts_file} has no prompts (only blank lines)")
        gen = load(args.checkpoint, device=args.device, dtype=args.dtype)
        _run(gen, prompts, args)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        return 130
    except BrokenPipeError:
        sys.stderr.close()  # the reader went away (e.g. `| head`): stop quietly
        return 0
    except (CheckpointError, GenerationError, ValueError, MemoryError, RuntimeError, OSError) as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
