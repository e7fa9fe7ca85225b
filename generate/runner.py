"""The runner: turns the engine's slots into model calls, eager or compiled.

Prefill runs one prompt into one slot (eager: prompts have many lengths). The decode step runs every slot at
once, each row at its own position, over a fixed span of cache positions: the same shapes at every step, so
:mod:`torch.compile` compiles it once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from generate.kernels import OneDNNLinear, onednn_pays
from model import GPT, KVCache


class Runner:
    """Calls the model for the engine.

    Args:
        model: the model (eval mode).
        cache: the engine's KV cache; the decode step reads ``cache.max_len`` positions of every slot.
        compile: compile the decode step (see :func:`generate.compiled.compile_step`).

    Attributes:
        onednn: whether the eager decode step runs its fp32 products in oneDNN
            (:class:`generate.kernels.OneDNNLinear`); measured on this machine when the runner is made
            (:func:`generate.kernels.onednn_pays`).
    """

    def __init__(self, model: GPT, cache: KVCache, *, compile: bool = False) -> None:
        self.model, self.cache = model, cache
        self._decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._eager_decode
        self.onednn = False
        if compile:
            from generate.compiled import compile_step

            self._decode = compile_step(model, cache)
        else:
            self.onednn = onednn_pays(model, cache.slots)

    def prefill(self, prompt: list[int], slot: int) -> torch.Tensor:
        """Write a prompt's keys and values into ``slot`` and return the last position's logits, (V,)."""
        device = self.model.device
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        positions = torch.arange(len(prompt), device=device)[None]
        logits = self.model(ids, positions=positions, cache=self.cache, slot=slot, span=len(prompt),
                            last_only=True)  # fmt: skip
        return logits[0, -1]

    def _eager_decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with OneDNNLinear() if self.onednn else contextlib.nullcontext():
            return self.model(tokens, positions=positions, cache=self.cache, last_only=True)[:, -1]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for every slot at its own position: (slots,) ids and positions -> (slots, V) logits."""
        device = self.model.device
        with torch.inference_mode():  # fresh inference tensors every step, as the compiled step was traced on
            return self._decode(tokens.to(device).clone()[:, None], positions.to(device).clone()[:, None])
