"""The runner: the engine's model calls. A prompt's chunk runs alone, eagerly; a step (eager or compiled) runs
every slot at once, each at its own position (idle ones at 0), reading the cache in whole chunks."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from model import GPT, KVCache


def forward_step(model: GPT, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, span: int,
                 embedded: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """A step's forward: the last position's logits for one token per row, every position's for more
    (``embedded``: the tokens' :meth:`model.GPT.embed`, if computed already)."""
    one = tokens.shape[1] == 1
    logits = model(tokens, positions=positions, cache=cache, span=span, last_only=one, step=True,
                   embedded=embedded)  # fmt: skip
    return logits[:, -1] if one else logits


class Runner:
    """Calls the model for the engine: steps of the ``widths`` given (tokens a slot; more verify proposals),
    with ``compile`` a library each (:func:`generate.engine.compiled.compile_step`, told ``progress``)."""

    def __init__(
        self,
        model: GPT,
        cache: KVCache,
        *,
        compile: bool = False,
        progress: Callable[[str], None] | None = None,
        widths: tuple[int, ...] = (1,),
    ) -> None:
        self.model, self.cache, self.compiled = model, cache, compile
        self._eager, self._steps = partial(forward_step, model, cache), {}  # (width -> its compiled step)
        if compile:
            from generate.engine.compiled import compile_step

            self._steps = {w: compile_step(model, cache, progress, w) for w in sorted(set(widths))}

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
        return self.verify(tokens.clone()[:, None], positions.clone()[:, None])  # (inference tensors)

    def verify(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(slots, T) ids at consecutive positions -> logits (slots, T, V), or (slots, V) for T = 1."""
        device = self.model.device
        step = self._steps[tokens.shape[1]] if self.compiled else self._eager
        return step(tokens.to(device), positions.to(device), self._span(positions))

    def _span(self, positions: torch.Tensor) -> int:
        """Cache positions a step reads: on the CPU up to the furthest row (the model rounds it up to whole
        chunks); a GPU's kernels split their sums by their shapes, so there always the whole cache."""
        return int(positions.max()) + 1 if self.model.device.type == "cpu" else self.cache.max_len
