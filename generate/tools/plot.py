"""Pictures of causal attention: heatmaps of who attends to whom, and the causal mask itself.

Needs matplotlib (``pip install -e ".[plot]"``). Figures are drawn with matplotlib's object API on the Agg
canvas (no pyplot, no global state, no display), so this works in a server or a headless job.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 100
LABELLED_TOKENS = 48  # up to this many tokens every one is named on the axes; beyond, positions only
ANNOTATED_TOKENS = 12  # up to this many tokens every cell shows its value


def require_matplotlib() -> None:
    """Raise ImportError with the install line when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError("pictures need matplotlib; install the extra with pip install -e '.[plot]'") from e


def token_labels(pieces: list[str]) -> list[str]:
    """Axis labels for tokens: a newline shown as ``\\n``, a tab as ``\\t``, a leading space as ``·``."""
    labels = []
    for piece in pieces:
        piece = piece.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
        labels.append("·" + piece[1:] if piece.startswith(" ") else piece or "∅")
    return labels


def grid_shape(panels: int) -> tuple[int, int]:
    """(rows, columns) for ``panels`` heads: as square as it goes, columns first."""
    columns = math.ceil(math.sqrt(panels))
    return math.ceil(panels / columns), columns


def default_size(panels: int) -> tuple[int, int]:
    """The picture's default size in pixels: 800 x 700 for one panel, 400 x 400 a panel in a grid."""
    if panels == 1:
        return 800, 700
    rows, columns = grid_shape(panels)
    return 400 * columns + 100, 400 * rows + 60


def smallest_size(panels: int) -> tuple[int, int]:
    """The smallest picture, in pixels, whose titles and labels do not collide: 500 x 400 for one panel,
    250 x 200 a panel in a grid (smaller, matplotlib gives up its layout)."""
    if panels == 1:
        return 500, 400
    rows, columns = grid_shape(panels)
    return 250 * columns + 100, 200 * rows + 100


def attention_figure(
    weights: torch.Tensor,
    tokens: list[str],
    *,
    titles: list[str],
    suptitle: str | None = None,
    size: tuple[int, int] | None = None,
    mask: bool = False,
) -> Figure:
    """A heatmap per panel of (T, T) attention weights: queries down, keys across, the future masked.

    Args:
        weights: (panels, T, T) or (T, T), row ``q`` holding how much query ``q`` attends to each key.
        tokens: the T tokens' text, labelling both axes.
        titles: one title per panel.
        suptitle: a title over the whole figure.
        size: (width, height) in pixels (default :func:`default_size`).
        mask: draw ``weights`` as the causal mask: allowed cells 0, blocked cells ``-inf``, as the
            notebooks write the mask added to the scores.

    Returns:
        The figure (on an Agg canvas); ``fig.savefig(path)`` writes it. Cells above the diagonal (a key
        after its query) are drawn hatched in grey, not with the colour of 0, so the mask is visible.
    """
    require_matplotlib()
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Polygon

    data = weights.detach().float().cpu()
    data = data[None] if data.dim() == 2 else data
    panels, t = data.shape[0], data.shape[-1]
    if data.shape[1:] != (t, t) or len(tokens) != t or len(titles) != panels:
        raise ValueError(
            f"weights of shape {tuple(weights.shape)} need {t} tokens and {panels} titles; got "
            f"{len(tokens)} tokens and {len(titles)} titles"
        )
    width, height = size or default_size(panels)
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    rows, columns = grid_shape(panels)
    future = np.triu(np.ones((t, t), dtype=bool), k=1)
    labels = token_labels(tokens)
    small = panels == 1
    for i in range(panels):
        ax = fig.add_subplot(rows, columns, i + 1)
        values = np.ma.masked_array(data[i].numpy(), mask=future)
        if mask:  # allowed cells one colour, blocked ones red, as the mask added to the scores
            image = ax.imshow(np.ma.masked_array(np.zeros((t, t)), mask=future),
                              cmap=_colormap("Blues", bad="#d62728"), vmin=0, vmax=1)  # fmt: skip
        else:  # blocked cells grey and hatched: read as "masked", not as a weight of 0
            image = ax.imshow(values, cmap=_colormap("viridis", bad="#d9d9d9"), vmin=0.0, vmax=1.0)
            if t > 1:
                ax.add_patch(
                    Polygon(_future_outline(t), fill=False, hatch="//", edgecolor="#8c8c8c", linewidth=0)
                )
        ax.set_title(titles[i], fontsize=11 if small else 9)
        _axes_labels(ax, labels, t, full=small)
        if t <= ANNOTATED_TOKENS and small:
            _annotate(ax, values, future, mask)
    if not mask:
        fig.colorbar(image, ax=fig.axes, shrink=0.8, label="attention weight")
    if suptitle:
        fig.suptitle(suptitle)
    return fig


def _future_outline(t: int) -> list[tuple[float, float]]:
    """The outline of the cells above the diagonal (key after query) of a (t, t) image, a staircase."""
    points = [(0.5, -0.5), (t - 0.5, -0.5), (t - 0.5, t - 1.5)]
    for q in range(t - 2, -1, -1):
        points += [(q + 0.5, q + 0.5), (q + 0.5, q - 0.5)]
    return points


def _annotate(ax, values, future, mask: bool) -> None:
    """Write each cell's value: the weight to two decimals, or the mask's 0 and -inf."""
    t = len(future)
    for q in range(t):
        for k in range(t):
            if mask:
                text, light = ("-inf", True) if future[q, k] else ("0", False)
            elif future[q, k]:
                continue
            else:
                text, light = f"{values[q, k]:.2f}", values[q, k] < 0.6
            ax.text(k, q, text, ha="center", va="center", fontsize=8, color="white" if light else "black")


def _colormap(name: str, bad: str | None = None):  # -> a matplotlib Colormap
    import matplotlib

    cmap = matplotlib.colormaps[name].copy()
    if bad is not None:
        cmap.set_bad(bad)
    return cmap


def _axes_labels(ax, labels: list[str], t: int, *, full: bool) -> None:
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    if t <= (LABELLED_TOKENS if full else LABELLED_TOKENS // 3):
        # (parse_math off: a label with two dollar signs, as the tokens "$$" and "$$$$", is text, not TeX)
        ax.set_xticks(range(t), labels, rotation=90, fontsize=8 if full else 6, parse_math=False)
        ax.set_yticks(range(t), labels, fontsize=8 if full else 6, parse_math=False)
    else:
        step = max(1, t // 8)
        ax.set_xticks(range(0, t, step))
        ax.set_yticks(range(0, t, step))
