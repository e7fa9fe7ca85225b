"""The ``gptgen attention`` command: picture a model's causal attention over a text.

Like ``generate``, only the standard library is imported at module level; torch, the model and matplotlib
are imported once the options are read (with Ctrl-C held during torch's import, see
:func:`generate.tools.runner.import_holding_signals`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from generate.tools.cli import argument_text, stdin_text
from generate.tools.command_base import add_common_options, run_parsed
from generate.tools.options import CommandParser, check_model_options, load_generator
from generate.tools.runner import import_holding_signals

MAX_MASK_TOKENS = 1024  # --mask loads no model, so no window bounds the text: this does
PICTURE_FORMATS = (".png", ".svg", ".pdf")

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
    add_common_options(p)
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


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[int, int] | None:
    """Refuse bad options (usage errors, exit 2); returns the picture's size (None: the default)."""
    check_model_options(args, parser)
    if Path(args.output).suffix.lower() not in PICTURE_FORMATS:
        parser.error(f"--output {args.output!r} must end in {', '.join(PICTURE_FORMATS)}")
    if Path(args.output).is_dir():
        parser.error(f"--output {args.output!r} is a folder; give a file in it, such as {args.output}/a.png")
    folder = Path(args.output).parent
    if not folder.is_dir():
        parser.error(f"--output {args.output!r}: the folder {folder} does not exist")
    try:  # (a file can be made there: found before the model runs)
        tempfile.NamedTemporaryFile(dir=folder, prefix=f".{Path(args.output).name}.").close()
    except OSError as e:
        parser.error(f"--output {args.output!r} cannot be written: {e.strerror or e}")
    if args.head is not None and args.mean:
        parser.error("give --head or --mean, not both")
    if args.mask and (args.head is not None or args.mean or args.layer is not None):
        parser.error("--mask draws the mask alone; leave out --layer, --head and --mean")
    return _size(args.size, parser)


def _attention(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    size = _check(args, parser)
    output = Path(args.output)
    text = argument_text(args.text, parser, "text")
    if text == "-":
        missing = "no text: give it as an argument, or pipe the text to standard input"
        text = stdin_text(parser, missing).removesuffix("\n")
    from generate.tools.plot import require_matplotlib

    require_matplotlib()  # before any model is loaded
    import_holding_signals("generate.api")
    if args.mask:
        tokenizer, ids, weights, titles, suptitle = _mask_weights(text)
    else:
        tokenizer, ids, weights, titles, suptitle = _model_weights(args, parser, text)
    from generate.tools.plot import attention_figure, smallest_size

    least = smallest_size(panels := len(weights) if weights.dim() == 3 else 1)
    if size is not None and (size[0] < least[0] or size[1] < least[1]):
        parser.error(f"--size {args.size} is too small for {panels} panel{'s' * (panels > 1)}: give at least "
                     f"{least[0]}x{least[1]}")  # fmt: skip
    pieces = [tokenizer.decode([i]) for i in ids]
    figure = attention_figure(weights, pieces, titles=titles, suptitle=suptitle, size=size, mask=args.mask)
    _save(figure, output)
    print(f"wrote {output} ({len(ids)} tokens)", file=sys.stderr)


def _mask_weights(text: str) -> tuple[Any, list[int], Any, list[str], str | None]:
    """The causal mask over ``text``'s tokens: tokenizer, token ids, weights, titles and suptitle."""
    import torch

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
    return tokenizer, ids, weights, titles, suptitle


def _model_weights(
    args: argparse.Namespace, parser: argparse.ArgumentParser, text: str
) -> tuple[Any, list[int], Any, list[str], str | None]:
    """The model's attention over ``text`` as the options ask: tokenizer, token ids, weights, titles and
    suptitle."""
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
    return tokenizer, ids, weights, titles, suptitle


def _save(figure, output: Path) -> None:  # figure: a matplotlib Figure
    """Write the picture whole or not at all: drawn to a temporary file beside it, then renamed."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", suffix=output.suffix, dir=output.parent)
    except OSError as e:  # (the folder went, or filled, since the options were checked)
        raise OSError(f"cannot write {output}: {e.strerror or e}") from None
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
    return run_parsed(_attention, build_attention_parser(), argv, "use a shorter text or a smaller --dtype")
