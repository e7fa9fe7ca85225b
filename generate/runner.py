"""The runner: turns the engine's slots into model calls, eager or compiled.

Prefill runs one prompt into one slot (eager: prompts have many lengths). The decode step runs every slot at
once, each row at its own position, over a fixed span of cache positions: the same shapes at every step, so
:mod:`torch.compile` compiles it once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from generate.kernels import OneDNNLinear, UpcastBF16, onednn_pays, upcast_min_rows
from model import GPT, KVCache


class Runner:
    """Calls the model for the engine.

    Args:
        model: the model (eval mode).
        cache: the engine's KV cache; the decode step reads ``cache.max_len`` positions of every slot.
        compile: compile the decode step (see :func:`generate.compiled.compile_step`).

    Attributes:
        onednn: whether the eager decode step runs its fp32 products in oneDNN
            (:class:`generate.kernels.OneDNNLinear`): where the products alone are faster there
            (:func:`generate.kernels.onednn_pays`), whole steps are timed both ways when the runner is made.
        upcast_rows: bf16 products of at least this many rows run in fp32 in eager calls (prefill, and the
            eager decode step), or None; measured on CPUs without native bf16
            (:func:`generate.kernels.upcast_min_rows`).
    """

    def __init__(self, model: GPT, cache: KVCache, *, compile: bool = False) -> None:
        self.model, self.cache = model, cache
        self._decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._eager_decode
        self.onednn = False
        self.upcast_rows = upcast_min_rows(model)
        if compile:
            from generate.compiled import compile_step

            self._decode = compile_step(model, cache)
        elif onednn_pays(model, cache.slots):
            self.onednn = self._steps_faster_with_onednn()

    def _steps_faster_with_onednn(self) -> bool:
        """Time whole eager decode steps both ways (best of 3 each, alternated): the route's mode costs
        some microseconds on every torch call, which a product's own timing does not show (on the shipped
        19M model, about 2.7 ms a step)."""
        tokens = torch.zeros(self.cache.slots, dtype=torch.long)
        best = {False: float("inf"), True: float("inf")}
        for _ in range(3):
            for onednn in best:
                self.onednn = onednn
                start = time.perf_counter()
                self.decode(
                    tokens, tokens
                )  # writes position 0 of every slot; a slot is cleared as a request joins
                best[onednn] = min(best[onednn], time.perf_counter() - start)
        return best[True] < 0.97 * best[False]

    def _eager_routes(self, decode: bool) -> contextlib.AbstractContextManager:
        if self.upcast_rows is not None:
            return UpcastBF16(self.upcast_rows)
        return OneDNNLinear() if decode and self.onednn else contextlib.nullcontext()

    def prefill(self, prompt: list[int], slot: int) -> torch.Tensor:
        """Write a prompt's keys and values into ``slot`` and return the last position's logits, (V,)."""
        device = self.model.device
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        positions = torch.arange(len(prompt), device=device)[None]
        with self._eager_routes(decode=False):
            logits = self.model(ids, positions=positions, cache=self.cache, slot=slot, span=len(prompt),
                                last_only=True)  # fmt: skip
        return logits[0, -1]

    def _eager_decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with self._eager_routes(decode=True):
            return self.model(tokens, positions=positions, cache=self.cache, last_only=True)[:, -1]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for every slot at its own position: (slots,) ids and positions -> (slots, V) logits."""
        device = self.model.device
        with torch.inference_mode():  # fresh inference tensors every step, as the compiled step was traced on
            return self._decode(tokens.to(device).clone()[:, None], positions.to(device).clone()[:, None])
