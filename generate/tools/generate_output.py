"""The ``generate`` command's run: the prompts checked against the model, then the completions generated and
printed (streamed, as text, or as JSON lines).

Only the standard library is imported at module level (see :mod:`generate.tools.cli`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from generate.tools.generate_options import SAMPLING_OPTIONS

if TYPE_CHECKING:
    from generate.api import Generator


class Output:
    """Standard output that remembers whether its last line is unfinished, so Ctrl-C can end just that."""

    def __init__(self) -> None:
        self.partial = False

    def write(self, text: str) -> None:
        """Write ``text`` to standard output and flush it."""
        if text:
            partial = not text.endswith("\n")
            # Marked before the write too: a Ctrl-C that lands just after the flush (before the line after
            # it runs) must still end the line it left open.
            self.partial = self.partial or partial
            try:
                sys.stdout.write(text)
            except UnicodeEncodeError as e:  # PYTHONIOENCODING=ascii, a C locale without UTF-8 mode
                raise ValueError(
                    f"standard output's encoding ({e.encoding}) cannot write {e.object[e.start]!r}; set "
                    "PYTHONIOENCODING=utf-8, or use --json"
                ) from None
            sys.stdout.flush()
            self.partial = partial


def json_line(record: dict) -> str:
    """``record`` as one JSON line, its text as is, or escaped (the same JSON) where standard output's
    encoding lacks a character."""
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        line = json.dumps(record)
    return line + "\n"


def check_prompts(gen: Generator, prompts: list[tuple[int | None, str]], prompts_file: str | None) -> None:
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


def run_generation(gen: Generator, prompts: list[str], args: argparse.Namespace, out: Output) -> None:
    """Generate ``--num-samples`` completions of every prompt and print them to ``out``: a lone completion
    streamed, others in batches of ``--batch-size``, as text or (``--json``) one JSON object each."""
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
                out.write(json_line(record))
            else:
                out.write(completion.text + ("\n\n" if total > 1 else "\n"))
