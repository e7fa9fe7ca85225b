"""KVCache: preallocated key/value rows (slots), each written at its own positions."""

from __future__ import annotations

import torch

from model.attention import CHUNK
from model.config import GPTConfig


class KVCache:
    """Static key/value buffers, one pair per layer (slots, n_head, positions, head_dim); each slot's length:
    a slot is one sequence's row at its own positions (no padding, no shared offset; the engine keeps
    ``lengths``). Nothing is written past ``max_len``; ``positions`` rounds it up to whole chunks (of
    :data:`model.attention.CHUNK`). Layers' buffers are separate tensors: a compiled step's inputs."""

    def __init__(self, config: GPTConfig, slots: int, max_len: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:  # fmt: skip
        if slots <= 0:
            raise ValueError(f"slots must be positive, got {slots}")
        if not 0 < max_len <= config.n_positions:
            raise ValueError(f"max_len must be in 1..{config.n_positions} (n_positions), got {max_len}")
        positions = -(-max_len // CHUNK) * CHUNK
        # One position more in storage, never used: a step's keys are then never the whole buffer, so a step
        # exported with a dynamic span needs no case for a contiguous slice (which torch.export refused).
        shape, layers = (slots, config.n_head, positions + 1, config.head_dim), range(config.n_layer)
        self.k = [torch.zeros(shape, dtype=dtype, device=device)[:, :, :positions] for _ in layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device)[:, :, :positions] for _ in layers]
        self.slots, self.max_len, self.lengths = slots, max_len, [0] * slots

    @classmethod
    def over(cls, k: list[torch.Tensor], v: list[torch.Tensor]) -> KVCache:
        """A cache over existing per-layer buffers of whole chunks (no copy), e.g. a traced step's inputs."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.slots, cache.max_len = list(k), list(v), k[0].shape[0], k[0].shape[2]
        cache.lengths = [0] * cache.slots
        return cache

    def layer(self, index: int, slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's key and value buffers, or with ``slot`` that slot's alone (views: writes land here)."""
        k, v = self.k[index], self.v[index]
        return (k, v) if slot is None else (k[slot : slot + 1], v[slot : slot + 1])

    def clear(self, slot: int) -> None:
        """Empty a slot for a new sequence: length 0 and every position zeroed, so nothing of the previous
        sequence (not even a non-finite value, which masking cannot hide) reaches the next."""
        for buffer in (*self.k, *self.v):
            buffer[slot].zero_()
        self.lengths[slot] = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.untyped_storage().nbytes() for b in (*self.k, *self.v))

    @staticmethod
    def bytes_per_token(config: GPTConfig, dtype: torch.dtype = torch.float32) -> int:
        """Cache bytes one position of one row takes: keys and values for every layer."""
        return 2 * config.n_layer * config.n_embd * dtype.itemsize
