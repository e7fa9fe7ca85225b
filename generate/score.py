"""Scoring text under the model: each token's log-probability, the mean negative log-likelihood, perplexity.

A text longer than the model's window is read in windows of ``n_positions`` tokens whose ends advance by
``stride`` tokens (default half the window). Every token after the first is scored exactly once, in the
first window that gives it at least ``n_positions - stride`` tokens of context (or all the tokens before
it): the first window scores all its tokens, each later one only the ``stride`` tokens past the previous
window's end, and the last window ends at the text's end with a full window of context behind it. A smaller
stride gives more context per token (a lower loss) for more compute: about ``n_positions / stride`` forwards
per scored token.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from generate.engine.engine import NOT_FINITE_ADVICE, GenerationError
from generate.engine.memory import said_plainly
from model import GPT

# Rows of the output head computed at once: (rows x vocabulary) fp32 logits, 51 MiB for GPT-2's 50,257.
HEAD_ROWS = 256
DEFAULT_BATCH_SIZE = 4  # windows per forward


@dataclass(frozen=True)
class Score:
    """How well the model predicts a text.

    Attributes:
        tokens: how many tokens were scored (all but the first).
        mean_nll: the mean negative log-likelihood, in nats per scored token.
        perplexity: ``exp(mean_nll)``.
        token_logprobs: each scored token's log-probability (natural log), in text order: entry ``i`` is
            that of ``token_ids[i + 1]``.
        token_ids: the text's tokens, the unscored first one included.
        window: the window length in tokens (``n_positions``, or the text's length if shorter).
        stride: how far each window's end advanced.
    """

    tokens: int
    mean_nll: float
    perplexity: float
    token_logprobs: list[float]
    token_ids: list[int]
    window: int
    stride: int

    def to_dict(self) -> dict[str, object]:
        """The score as plain JSON-ready values."""
        return asdict(self)


@dataclass(frozen=True)
class Window:
    """Tokens ``begin .. end - 1`` of the text, of which ``first .. end - 1`` are scored here."""

    begin: int
    end: int
    first: int


def plan_windows(n: int, window: int, stride: int) -> list[Window]:
    """The windows that score ``n`` tokens (see the module's docstring); all as long as ``min(n, window)``."""
    end = min(window, n)
    windows = [Window(0, end, 1)]
    while end < n:
        new_end = min(end + stride, n)
        windows.append(Window(new_end - window, new_end, end))
        end = new_end
    return windows


def check_stride(stride: object, window: int) -> int:
    """``stride`` checked against the window (None: half of it); returns the stride."""
    if stride is None:
        return max(1, window // 2)
    if isinstance(stride, bool) or not isinstance(stride, numbers.Integral) or not 1 <= stride < window:
        raise ValueError(
            f"stride={stride!r} is out of range; it must be an integer in 1..{window - 1} (the window of "
            f"{window} tokens minus 1, so every scored token has context); the default is {window // 2}"
        )
    return int(stride)


@torch.inference_mode()
def score_ids(
    model: GPT,
    ids: Sequence[int],
    *,
    stride: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Callable[[int, int], None] | None = None,
) -> Score:
    """Score token ids under ``model`` (eval mode, the reference forward); see :class:`Score`.

    Args:
        model: the model.
        ids: the tokens, at least two.
        stride: how far each window's end advances, in 1..n_positions-1 (default half the window).
        batch_size: windows computed together.
        progress: called with (tokens scored so far, tokens to score) after each batch.

    The model is scored as it computes: in bf16 and the quantized modes the logits are bf16, as in
    generation, so each token's log-probability carries bf16's rounding (its spacing is 1/16 at logits of
    8-16); the mean over many tokens much less (the tests bound the mean's change from fp32).

    Raises:
        ValueError: for fewer than two tokens, an id outside the vocabulary, or a stride or batch size out
            of range.
        GenerationError: if the model's logits hold NaN or infinity (a corrupt checkpoint, fp16 overflow).
        MemoryError: if the allocator runs out of memory (said plainly).
    """
    with said_plainly("score fewer windows at once (batch_size), or use a smaller dtype"):
        return _score_ids(model, list(ids), stride, batch_size, progress)


def _score_ids(
    model: GPT,
    ids: list[int],
    stride: int | None,
    batch_size: int,
    progress: Callable[[int, int], None] | None,
) -> Score:
    cfg = model.config
    if len(ids) < 2:
        raise ValueError(
            f"the text has {len(ids)} token{'s' * (len(ids) != 1)}; scoring needs at least 2 (the first "
            "token is context only)"
        )
    if cfg.n_positions < 2:
        raise ValueError(f"a model of n_positions={cfg.n_positions} cannot score: it sees one token at most")
    bad = next((t for t in ids if not 0 <= t < cfg.vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary 0..{cfg.vocab_size - 1}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    batch_size = int(batch_size)  # (a numpy integer too)
    stride = check_stride(stride, cfg.n_positions)
    windows = plan_windows(len(ids), cfg.n_positions, stride)
    tokens = torch.tensor(ids, dtype=torch.long)
    logprobs: list[torch.Tensor] = []
    done, total = 0, len(ids) - 1
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        x = torch.stack([tokens[w.begin : w.end] for w in batch]).to(model.device)
        hidden = model.hidden_states(x)  # (B, T, C)
        # Position p's logits predict token p + 1: a window scores tokens first..end-1 from the hidden states
        # at first-1..end-2 (relative to its begin).
        pieces = zip(hidden, batch, strict=True)
        rows = torch.cat([h[w.first - 1 - w.begin : w.end - 1 - w.begin] for h, w in pieces])
        targets = torch.cat([tokens[w.first : w.end] for w in batch]).to(model.device)
        for start in range(0, len(rows), HEAD_ROWS):
            logits = model.wte.project(rows[start : start + HEAD_ROWS]).float()  # (rows, V)
            if not math.isfinite(logits.sum()) and not torch.isfinite(logits).all():  # (finite sum: all are)
                raise GenerationError(
                    f"the model produced NaN or infinite logits (dtype {model.compute_dtype}) scoring tokens "
                    f"{done + start + 1}..{done + start + len(logits)}; {NOT_FINITE_ADVICE}"
                )
            # (cross_entropy's fused log-softmax: a third faster here than gather minus logsumexp)
            nll = F.cross_entropy(logits, targets[start : start + HEAD_ROWS], reduction="none")
            logprobs.append(-nll.cpu())
        done += len(targets)
        if progress is not None:
            progress(done, total)
    values = torch.cat(logprobs)
    mean_nll = -values.double().sum().item() / len(values)
    return Score(
        tokens=len(values),
        mean_nll=mean_nll,
        perplexity=math.exp(mean_nll) if mean_nll < 709 else math.inf,  # (exp overflows a float past 709.78)
        token_logprobs=values.tolist(),
        token_ids=ids,
        window=min(cfg.n_positions, len(ids)),
        stride=stride,
    )
