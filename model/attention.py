"""CausalAttention: multi-head causal self-attention with a sliced mask buffer and an optional KV cache."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.linear import Linear


class CausalAttention(nn.Module):
    """Multi-head causal self-attention, GPT-2 style (fused ``c_attn`` projection, ``c_proj`` output).

    The causal mask is built once, as ``torch.triu(ones, diagonal=1)`` (True = may not attend), and kept as
    a non-persistent buffer. Each call slices it to the current query rows ``offset..offset+T`` and key
    columns ``0..offset+T`` and applies it with ``-inf`` before the softmax.

    Args:
        d_in: width of the input.
        d_out: width of the output; split into ``num_heads`` heads of ``d_out // num_heads``.
        context_length: the longest sequence the mask covers.
        dropout: dropout probability on the attention weights, applied in training only.
        num_heads: number of heads.
        qkv_bias: whether the query, key and value projections have a bias.

    Raises:
        ValueError: if ``d_out`` is not divisible by ``num_heads`` or a size is not positive.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float = 0.0,
        num_heads: int = 1,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        if min(d_in, d_out, context_length, num_heads) <= 0:
            raise ValueError(
                f"CausalAttention sizes must be positive, got d_in={d_in}, d_out={d_out}, "
                f"context_length={context_length}, num_heads={num_heads}"
            )
        if d_out % num_heads != 0:
            raise ValueError(f"d_out ({d_out}) must be divisible by num_heads ({num_heads})")
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.context_length = context_length
        self.dropout = dropout
        self.c_attn = Linear(d_in, 3 * d_out, bias=qkv_bias)  # query, key, value stacked in that order
        self.c_proj = Linear(d_out, d_out)
        self.register_buffer(
            "mask", self._causal_mask(context_length, self.c_attn.weight.device), persistent=False
        )

    @staticmethod
    def _causal_mask(context_length: int, device: torch.device | None) -> torch.Tensor:
        ones = torch.ones(context_length, context_length, dtype=torch.bool, device=device)
        if ones.is_meta:  # shapes only; reset_buffers() builds the mask once the model has real memory
            return ones  # (a meta triu runs a Python reference that imports torch._dynamo, 75 MB resident)
        return torch.triu(ones, diagonal=1)

    def reset_buffers(self) -> None:
        """Rebuild the causal mask in place (after ``to_empty``, which leaves buffers uninitialised)."""
        self.mask = self._causal_mask(self.context_length, self.mask.device)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.d_out, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        return tuple(z.view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))

    def _blocked(self, t: int, offset: int, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        """Boolean mask, True where a query may not attend: (T, S) or (B, 1, T, S) with padding."""
        s = offset + t
        if s > self.context_length:
            raise ValueError(
                f"sequence of {s} positions exceeds this attention's context_length "
                f"({self.context_length}); shorten the input"
            )
        blocked = self.mask[offset:s, :s]  # query rows offset..s, key columns 0..s
        if key_padding_mask is None:
            return blocked
        if key_padding_mask.shape[-1] != s:
            raise ValueError(
                f"key_padding_mask covers {key_padding_mask.shape[-1]} positions but the keys span {s} "
                f"(offset {offset} + {t} new); pass one entry per cached and new token"
            )
        padded = ~key_padding_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
        # A padding query would see only padding keys: a row of -inf gives NaN. Let every query see itself,
        # which leaves real rows unchanged (their own key is real) and keeps padding rows finite.
        own = (
            torch.arange(s, device=blocked.device) == torch.arange(offset, s, device=blocked.device)[:, None]
        )
        return (blocked | padded) & ~own

    def _attend_keys(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        offset: int,
        kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kv is None:
            if offset != 0:
                raise ValueError(f"offset={offset} needs a KV cache holding the first {offset} positions")
            return k, v
        k_buf, v_buf = kv  # (B, nh, max_len, hs), written in place: no growth, no concatenation
        end = offset + k.shape[2]
        if end > k_buf.shape[2]:
            raise ValueError(
                f"KV cache holds {k_buf.shape[2]} positions but {end} are needed; allocate a larger cache"
            )
        k_buf[:, :, offset:end] = k
        v_buf[:, :, offset:end] = v
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def attention_weights(
        self,
        x: torch.Tensor,
        *,
        offset: int = 0,
        key_padding_mask: torch.Tensor | None = None,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The softmax attention weights, computed explicitly: (B, num_heads, T, offset + T).

        Same arguments as :meth:`forward`. Dropout is applied in training mode, as in ``forward``.
        """
        q, k, v = self._qkv(x)
        k, _ = self._attend_keys(k, v, offset, kv)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, nh, T, S)
        scores = scores.masked_fill(self._blocked(x.shape[1], offset, key_padding_mask), float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return F.dropout(weights, self.dropout, training=self.training)

    def forward(
        self,
        x: torch.Tensor,
        *,
        offset: int = 0,
        key_padding_mask: torch.Tensor | None = None,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attend each of the ``T`` new positions to itself and everything before it.

        Args:
            x: input of shape (B, T, d_in); its positions are ``offset .. offset + T``.
            offset: how many positions precede ``x`` (already written to ``kv``).
            key_padding_mask: (B, offset + T), true/1 for real tokens and false/0 for padding, which no
                query attends to. Padding queries attend only to themselves, so their output stays finite.
            kv: preallocated key and value buffers, each (B, num_heads, max_len, head_dim); the new keys and
                values are written at ``offset .. offset + T`` and attention reads ``0 .. offset + T``.

        Returns:
            Tensor of shape (B, T, d_out).
        """
        b, t, _ = x.shape
        q, k, v = self._qkv(x)
        k, v = self._attend_keys(k, v, offset, kv)
        blocked = self._blocked(t, offset, key_padding_mask)
        # One new token without padding sees every cached key: its mask row is all False, so skip it.
        allowed = None if (t == 1 and key_padding_mask is None) else ~blocked
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs), scaled by 1/sqrt(hs)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, self.d_out))
