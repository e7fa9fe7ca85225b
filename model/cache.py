"""KVCache: preallocated key/value rows (slots), each written at its own positions."""

from __future__ import annotations

import torch

from model.attention import CHUNK
from model.config import GPTConfig


class KVCache:
    """Static key/value buffers, one pair per layer of shape (slots, n_head, positions, head_dim), and each
    slot's length. ``positions`` is ``max_len`` rounded up to whole chunks of
    :data:`model.attention.CHUNK` positions (a decode step reads whole chunks; the positions past ``max_len``
    are never written and stay zero).

    A slot is one sequence's row. ``GPT.forward(..., cache=cache, positions=...)`` writes the new keys and
    values of each row at that row's own positions (an index write) and attention masks by position, so
    slots hold sequences of different lengths side by side: no padding, no shared offset, no shifting.
    ``lengths[s]`` is how many positions slot ``s`` holds; whoever feeds the model (the engine) keeps it.
    Each layer's buffers are separate tensors, so a compiled step takes them as separate inputs and writes
    each in place.

    Args:
        config: the model's configuration.
        slots: rows in the cache.
        max_len: positions each slot holds, at most ``config.n_positions``.
        dtype: element type, normally the model's compute dtype.
        device: where the buffers live.

    Raises:
        ValueError: if ``slots`` or ``max_len`` is not positive or ``max_len`` exceeds the window.
    """

    def __init__(
        self,
        config: GPTConfig,
        slots: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if slots <= 0:
            raise ValueError(f"slots must be positive, got {slots}")
        if not 0 < max_len <= config.n_positions:
            raise ValueError(
                f"max_len must be in 1..{config.n_positions} (the model's n_positions), got {max_len}"
            )
        made = (config, slots, max_len, dtype, device)
        self.k = [self.buffer(*made) for _ in range(config.n_layer)]
        self.v = [self.buffer(*made) for _ in range(config.n_layer)]
        self.slots = slots
        self.max_len = max_len
        self.lengths = [0] * slots

    @staticmethod
    def buffer(
        config: GPTConfig, slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str | None
    ) -> torch.Tensor:
        """One layer's zeroed key (or value) buffer, (slots, n_head, positions, head_dim), ``max_len``
        rounded up to whole chunks.

        Its storage holds one position more, never used: the keys a step reads are then never the whole
        buffer, so a step exported with its span as a dynamic size needs no case for the span that would be
        (``torch.export`` refused the span's range: whether the slice is contiguous depends on it).
        """
        positions = -(-max_len // CHUNK) * CHUNK
        shape = (slots, config.n_head, positions + 1, config.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device)[:, :, :positions]

    @classmethod
    def over(cls, k: list[torch.Tensor], v: list[torch.Tensor]) -> KVCache:
        """A cache over existing per-layer buffers (no copy), e.g. a traced step's inputs; lengths are 0."""
        cache = cls.__new__(cls)
        cache.k, cache.v = list(k), list(v)
        cache.slots, cache.max_len = k[0].shape[0], k[0].shape[2]  # (whole chunks: a traced step's)
        cache.lengths = [0] * cache.slots
        return cache

    def layer(self, index: int, slot: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's key and value buffers, each (slots, n_head, positions, head_dim), or with ``slot``
        that slot's alone, (1, n_head, positions, head_dim) (views: writes land in the cache)."""
        if slot is None:
            return self.k[index], self.v[index]
        return self.k[index][slot : slot + 1], self.v[index][slot : slot + 1]

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
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.n_layer * config.n_embd * itemsize
