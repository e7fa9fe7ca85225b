"""The runner: the engine's model calls. A prompt's chunk runs alone, eagerly; a step (eager or compiled) runs
every slot at once, each at its own position (idle ones at 0), reading the cache in whole chunks."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from model import GPT, KVCache


def forward_step(model: GPT, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, span: int,
                 embedded: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """A step's forward: (slots, T) tokens -> every position's logits, (slots, T, V) (``embedded``: the
    tokens' :meth:`model.GPT.embed`, if computed already)."""
    return model(tokens, positions=positions, cache=cache, span=span, step=True, embedded=embedded)


Progress = Callable[[str], None] | None  # told of a compile's progress, a line at a time


class Runner:
    """Calls the model for the engine: steps of the ``widths`` given (tokens a slot; more verify proposals),
    with ``compile`` compiled (:func:`generate.engine.compiled.compile_steps`, told ``progress``)."""

    def __init__(self, model: GPT, cache: KVCache, *, compile: bool = False, progress: Progress = None,
                 widths: tuple[int, ...] = (1,)) -> None:  # fmt: skip
        self.model, self.cache, self.compiled = model, cache, compile
        self._eager, self._steps = partial(forward_step, model, cache), {}  # (width -> its compiled step)
        if compile:
            from generate.engine.compiled import compile_steps

            self._steps = compile_steps(model, cache, progress, widths)

    def prefill(self, tokens: list[int], slot: int, start: int = 0) -> torch.Tensor:
        """Write ``tokens`` (a chunk of a prompt, from position ``start``) into ``slot``, attending to the
        positions before too; return the last position's logits, (V,)."""
        device, end = self.model.device, start + len(tokens)
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        positions = torch.arange(start, end, device=device)[None]
        logits = self.model(ids, positions=positions, cache=self.cache, slot=slot, span=end, last_only=True)
        return logits[0, -1]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for every slot at its own position: (slots,) ids and positions -> (slots, V) logits."""
        return self.verify(tokens.clone()[:, None], positions.clone()[:, None])[:, 0]  # (inference tensors)

    def fits(self, width: int) -> bool:
        """Whether a step may feed ``width`` tokens a slot (eager: any; compiled: a width it was made for)."""
        return not self.compiled or width in self._steps

    def verify(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(slots, T) ids at consecutive positions -> logits (slots, T, V)."""
        device = self.model.device
        step = self._steps[tokens.shape[1]] if self.compiled else self._eager
        # The cache positions read: on the CPU up to the furthest row (the model rounds up to whole chunks); a
        # GPU's kernels split their sums by their shapes, so there always the whole cache.
        span = int(positions.max()) + 1 if device.type == "cpu" else self.cache.max_len
        return step(tokens.to(device), positions.to(device), span)
