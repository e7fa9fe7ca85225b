"""TiedEmbedding: GPT-2's token embedding, which is also its output head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TiedEmbedding(nn.Embedding):
    """The token embedding, which is also the output head: :meth:`project` maps hidden states to logits."""

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``x @ weight.T``, (..., n_embd) -> (..., vocab_size)."""
        return F.linear(x, self.weight)
