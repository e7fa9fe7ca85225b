"""The ``generate`` command's options: its argument parser, and the checks that refuse bad options as usage
errors before anything is loaded.

Only the standard library is imported at module level (see :mod:`generate.tools.cli`); :func:`check_options`
imports torch.
"""

from __future__ import annotations

import argparse

from generate.tools.options import (
    CommandParser,
    add_checkpoint_option,
    add_draft_option,
    add_model_options,
    check_model_options,
    unescape,
)

MAX_BATCH_SIZE = 65_536  # far beyond any memory: each row holds ~2.4 MB of vocabulary-sized state alone
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
    _add_sampling_options(p)
    _add_output_options(p)
    return p  # fmt: skip


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    """``--max-new-tokens`` to ``--stop``: how long and how each completion is sampled."""
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


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """``--num-samples`` to ``--deterministic``: how many completions, run how, printed how."""
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
        help="run the decode step compiled: half a minute or more to compile the first time for each "
        "checkpoint, dtype and width (one prompt: 1 row; more: --batch-size rows), then kept on disk and "
        "loaded in seconds; pays off for long or many generations",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="run every prompt in an engine of --batch-size rows, so that a prompt gives the same bits alone "
        "or in a batch (a lone prompt then takes 1.4-2.6x the time a token on GPT-2 124M, Zen 4)",
    )


def check_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
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
    from generate.engine.request import check_seed, check_stop
    from generate.engine.sampling import SamplingParams

    check_model_options(args, parser)
    try:
        SamplingParams(**{name: getattr(args, name) for name in SAMPLING_OPTIONS})
        check_stop(args.stop)
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
