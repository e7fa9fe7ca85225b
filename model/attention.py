"""CausalAttention: multi-head causal self-attention, full-sequence or over a KV cache at row positions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# The kept causal mask covers at most this many positions (4 MiB of bools); a longer sequence builds its own.
MASK_BUFFER_POSITIONS = 2048

# A decode step sums cache positions in chunks of this many (CausalAttention.decode); caches hold whole ones.
CHUNK = 64


class CausalAttention(nn.Module):
    """GPT-2's multi-head causal self-attention (fused ``c_attn``, ``c_proj``); uncached, the reference."""

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float = 0.0, num_heads: int = 1,
                 qkv_bias: bool = False) -> None:  # fmt: skip
        super().__init__()
        if min(d_in, d_out, context_length, num_heads) <= 0:
            raise ValueError(f"CausalAttention sizes must be positive, got d_in={d_in}, d_out={d_out}, "
                             f"context_length={context_length}, num_heads={num_heads}")  # fmt: skip
        if d_out % num_heads != 0:
            raise ValueError(f"d_out ({d_out}) must be divisible by num_heads ({num_heads})")
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.context_length, self.dropout = context_length, dropout
        self.c_attn = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)  # query, key, value stacked in that order
        self.c_proj = nn.Linear(d_out, d_out)
        self.register_buffer("mask", self._causal_mask(self.c_attn.weight.device), persistent=False)

    def _causal_mask(self, device: torch.device | None, size: int | None = None) -> torch.Tensor:
        size = min(self.context_length, MASK_BUFFER_POSITIONS) if size is None else size
        ones = torch.ones(size, size, dtype=torch.bool, device=device)
        # On meta (shapes only) reset_buffers() builds the mask once the model has real memory.
        return ones if ones.is_meta else torch.triu(ones, diagonal=1)

    def reset_buffers(self) -> None:
        """Rebuild the causal mask in place (after ``to_empty``, which leaves buffers uninitialised)."""
        self.mask = self._causal_mask(self.mask.device)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.d_out, dim=2)  # (B, T, C) each, returned as (B, nh, T, hs)
        return tuple(z.view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))

    def _blocked(self, t: int) -> torch.Tensor:
        """The reference mask for ``t`` positions from 0: (T, T), True where a query may not attend."""
        if t > self.context_length:
            msg = f"sequence of {t} positions exceeds this attention's context_length ({self.context_length})"
            raise ValueError(f"{msg}; shorten the input")
        if t > self.mask.shape[0]:  # past the kept buffer: this call's own
            return self._causal_mask(self.mask.device, t)
        return self.mask[:t, :t]

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The reference's softmax attention weights, (B, num_heads, T, T), with dropout in training mode."""
        q, k, _ = self._qkv(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, nh, T, T)
        scores = scores.masked_fill(self._blocked(x.shape[1]), float("-inf"))
        return F.dropout(torch.softmax(scores, dim=-1), self.dropout, training=self.training)

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        span: int | None = None,
        step: bool = False,
    ) -> torch.Tensor:
        """Attend each new position of ``x`` (B, T, d_in) to itself and every earlier one: (B, T, d_out).

        With ``kv``, the rows' key and value caches (B, num_heads, positions, head_dim), the new keys and
        values are written at ``positions`` (B, T), and attention reads cache positions ``0 .. span-1``
        (default all; those past a row's positions are masked but must be finite: NaN times 0 is NaN). It sums
        in fixed chunks (:meth:`decode`) with one new token per row, or with ``step`` several."""
        b, t, _ = x.shape
        q, k, v = self._qkv(x)
        if kv is None:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=~self._blocked(t), dropout_p=self.dropout if self.training else 0.0
            )  # (B, nh, T, hs), scaled by 1/sqrt(hs)
        else:
            if positions is None:
                raise ValueError("attention over a KV cache needs the positions of the new tokens")
            k_buf, v_buf = kv
            # k_buf[rows, :, positions] is (B, T, nh, hs): the advanced indices come first.
            rows = torch.arange(b, device=x.device)[:, None]
            k_buf[rows, :, positions], v_buf[rows, :, positions] = k.transpose(1, 2), v.transpose(1, 2)
            span = k_buf.shape[2] if span is None else span
            keys, values = k_buf[:, :, :span], v_buf[:, :, :span]
            blocked = torch.arange(span, device=x.device) > positions[:, None, :, None]  # (B, 1, T, span)
            if step or t == 1:  # (step first: a compiled step's t may be symbolic)
                y = self.decode(q, keys, values, blocked)
            else:
                y = F.scaled_dot_product_attention(q, keys, values, attn_mask=~blocked)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, self.d_out))

    def decode(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor
    ) -> torch.Tensor:
        """Attention for a few queries per row whose bits depend on the row alone, not on the span.

        ``q`` (B, nh, T, hs), ``keys`` and ``values`` (B, nh, span, hs), ``blocked`` (B, 1, T, span) True
        past the query's position -> (B, nh, T, hs) in the cache's dtype, via fp32 (B x nh x T x span x hs
        products held: a step's few queries, not a prompt's). Each sum has a length the model fixes
        (``head_dim``, :data:`CHUNK` positions, then the chunks in order); a chunk wholly past a row's
        positions adds exactly 0 and the maximum is exact in any order, so more chunks change no bits."""
        b, nh, t, hs = q.shape
        chunks, compiling = keys.shape[2] // CHUNK, torch.compiler.is_compiling()
        if not compiling and keys.shape[2] % CHUNK:
            raise ValueError(f"a decode step reads whole chunks of {CHUNK} cache positions; got a span of "
                             f"{keys.shape[2]} (a model.KVCache holds whole chunks)")  # fmt: skip
        # Compiled for the CPU, products summed: no batched GEMM, so every GEMM follows its kernel rule
        q, sums = q.float() * (1.0 / math.sqrt(hs)), compiling and q.device.type == "cpu"
        scores = (q[:, :, :, None] * keys.float()[:, :, None]).sum(-1) if sums else q @ keys.float().mT
        scores = scores.masked_fill(blocked, float("-inf"))
        weights = torch.exp(scores - scores.amax(-1, keepdim=True)).view(b, nh, t, chunks, CHUNK, 1)
        parts = (weights * values.float().view(b, nh, 1, chunks, CHUNK, hs)).sum(4)  # (B, nh, T, chunks, hs)
        totals = weights.sum(4)  # (B, nh, T, chunks, 1)
        y = parts.cumsum(3)[:, :, :, -1] / totals.cumsum(3)[:, :, :, -1]  # (B, nh, T, hs)
        return y.to(values.dtype)
