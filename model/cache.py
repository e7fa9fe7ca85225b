"""KVCache: preallocated key/value buffers for incremental decoding, written in place."""

from __future__ import annotations

import torch

from model.config import GPTConfig


class KVCache:
    """Static key/value buffers of shape (n_layer, B, n_head, max_len, head_dim), plus a fill level.

    Allocated once per request batch; ``GPT.forward(..., cache=cache)`` writes the new positions at
    ``length .. length + T`` and advances ``length``. Nothing grows or is concatenated.

    Args:
        config: the model's configuration.
        batch_size: rows in the batch.
        max_len: positions to hold, at most ``config.n_positions``.
        dtype: element type, normally the model's.
        device: where the buffers live.

    Raises:
        ValueError: if ``batch_size`` or ``max_len`` is not positive or ``max_len`` exceeds the window.
    """

    def __init__(
        self,
        config: GPTConfig,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 < max_len <= config.n_positions:
            raise ValueError(
                f"max_len must be in 1..{config.n_positions} (the model's n_positions), got {max_len}"
            )
        shape = (config.n_layer, batch_size, config.n_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers of one layer, each (B, n_head, max_len, head_dim)."""
        return self.k[index], self.v[index]

    def drop_front(self, n: int) -> None:
        """Discard the first ``n`` cached positions, moving the rest to the front (frees room at the end).

        Used when every row still generating has at least ``n`` leading padding positions, which carry no
        information: dropping them lets shorter rows of a left-padded batch use the whole window.
        """
        if not 0 <= n <= self.length:
            raise ValueError(f"can drop 0..{self.length} cached positions, not {n}")
        keep = self.length - n
        self.k[:, :, :, :keep] = self.k[:, :, :, n : self.length].clone()  # ranges overlap: copy first
        self.v[:, :, :, :keep] = self.v[:, :, :, n : self.length].clone()
        self.length = keep

    def reset(self) -> None:
        """Forget the cached positions (the buffers are reused, not cleared)."""
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def bytes_per_token(config: GPTConfig, dtype: torch.dtype = torch.float32) -> int:
        """Cache bytes one position of one row takes: keys and values for every layer."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.n_layer * config.n_embd * itemsize
