"""The runner: turns the engine's slots into model calls, eager or compiled.

Each prompt is prefilled alone, eagerly, in chunks the engine cuts at fixed positions: its shapes are its
own, so its logits and its keys and values do not depend on any other request. A decode step runs every
slot at once, one token each at its own position (idle slots too, at position 0), and on the CPU reads the
cache positions up to the furthest row's, in whole chunks of :data:`model.attention.CHUNK` positions; a
row's attention gives the same bits over any number of chunks (:meth:`model.CausalAttention.decode`), and
every product has the same shapes in every step, so a row's bits depend on that row alone. Elsewhere
(CUDA) every step reads the whole cache: the same shapes always.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model import GPT, KVCache


class Runner:
    """Calls the model for the engine.

    Args:
        model: the model (eval mode).
        cache: the engine's KV cache.
        compile: run the decode step compiled (:func:`generate.engine.compiled.compile_step`).
        progress: with ``compile``, called with a line of text as the compile goes on.
        width: tokens per slot in a step: 1 (decode steps), or more (speculative steps, :meth:`verify`).
    """

    def __init__(
        self,
        model: GPT,
        cache: KVCache,
        *,
        compile: bool = False,
        progress: Callable[[str], None] | None = None,
        width: int = 1,
    ) -> None:
        self.model, self.cache = model, cache
        self._step: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None
        if compile:
            from generate.engine.compiled import compile_step

            self._step = compile_step(model, cache, progress, width)

    def prefill(self, tokens: list[int], slot: int, start: int = 0) -> torch.Tensor:
        """Write a prompt's keys and values for positions ``start ..`` (``tokens``, a chunk of it) into
        ``slot``, attending over the positions before too; return the last position's logits, (V,)."""
        device = self.model.device
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        positions = torch.arange(start, start + len(tokens), device=device)[None]
        logits = self.model(ids, positions=positions, cache=self.cache, slot=slot, span=start + len(tokens),
                            last_only=True)  # fmt: skip
        return logits[0, -1]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for every slot at its own position: (slots,) ids and positions -> (slots, V) logits."""
        device = self.model.device
        tokens, rows = tokens.to(device).clone()[:, None], positions.to(device).clone()[:, None]
        span = self._span(positions)
        if self._step is not None:
            return self._step(tokens, rows, span)
        return self.model(tokens, positions=rows, cache=self.cache, span=span, last_only=True)[:, -1]

    def verify(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A speculative step: several tokens for every slot at consecutive positions, attention as in a
        decode step (the same bits over any span): (slots, T) ids and positions -> (slots, T, V) logits."""
        device, span = self.model.device, self._span(positions)
        tokens, positions = tokens.to(device), positions.to(device)
        if self._step is not None:
            return self._step(tokens, positions, span)
        return self.model(tokens, positions=positions, cache=self.cache, span=span, step=True)

    def _span(self, positions: torch.Tensor) -> int:
        """The cache positions a step reads. The CPU reads up to the furthest row (in whole chunks: the model
        rounds it up); a GPU's kernels split their sums by the shapes they are given, so there every step
        reads the whole cache."""
        return int(positions.max()) + 1 if self.model.device.type == "cpu" else self.cache.max_len
