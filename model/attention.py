"""CausalAttention: multi-head causal self-attention, full-sequence or over a KV cache at row positions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

# The kept causal mask covers at most this many positions (4 MiB of bools); a longer sequence builds its own
# per call. A model of 40,000 positions once held a 1.6 GB mask it might never use.
MASK_BUFFER_POSITIONS = 2048

# An eager decode step upcasts 16-bit keys and values in pieces of rows whose upcast keys take at most this
# many bytes: glibc's malloc maps larger temporaries afresh every call (an eager int8 step of GPT-2 124M at 8
# rows x 1,024 positions took 2.5x as long in one piece). Rows are independent, so pieces change no bits.
ROW_PIECE_BYTES = 8 << 20


class CausalAttention(nn.Module):
    """Multi-head causal self-attention, GPT-2 style (fused ``c_attn`` projection, ``c_proj`` output).

    Two ways to call it:

    - The reference: the whole sequence at once, no cache. The causal mask is built once, as
      ``torch.triu(ones, diagonal=1)`` (True = may not attend), kept as a non-persistent buffer (of up to
      :data:`MASK_BUFFER_POSITIONS` positions; longer sequences build theirs per call), sliced to the
      sequence and applied with ``-inf`` before the softmax.
    - Over a KV cache, with explicit positions: every row has its own positions. The new keys and values are
      written into the row's cache at those positions (an index write), and a query at position ``p`` attends
      to the cached keys at positions ``<= p`` (a mask made from positions). Rows never share an offset.

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
        self.c_attn = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)  # query, key, value stacked in that order
        self.c_proj = nn.Linear(d_out, d_out)
        self.register_buffer(
            "mask", self._causal_mask(context_length, self.c_attn.weight.device), persistent=False
        )

    @staticmethod
    def _causal_mask(context_length: int, device: torch.device | None) -> torch.Tensor:
        size = min(context_length, MASK_BUFFER_POSITIONS)
        ones = torch.ones(size, size, dtype=torch.bool, device=device)
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

    def _blocked(self, t: int) -> torch.Tensor:
        """The reference mask for ``t`` positions from 0: (T, T), True where a query may not attend."""
        if t > self.context_length:
            raise ValueError(
                f"sequence of {t} positions exceeds this attention's context_length "
                f"({self.context_length}); shorten the input"
            )
        if t > self.mask.shape[0]:  # past the kept buffer: this call's own (its scores are larger still)
            return torch.triu(torch.ones(t, t, dtype=torch.bool, device=self.mask.device), diagonal=1)
        return self.mask[:t, :t]

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The reference's softmax attention weights, computed explicitly: (B, num_heads, T, T).

        Dropout is applied in training mode, as in ``forward``.
        """
        q, k, _ = self._qkv(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, nh, T, T)
        scores = scores.masked_fill(self._blocked(x.shape[1]), float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return F.dropout(weights, self.dropout, training=self.training)

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        span: int | None = None,
        segments: Sequence[tuple[int, int]] | None = None,
        shared: Shared | None = None,
    ) -> torch.Tensor:
        """Attend each new position to itself and every earlier one.

        Args:
            x: input of shape (B, T, d_in).
            positions: (B, T) position of every new token in its row; needed with ``kv``. Without ``kv``
                the positions are ``0 .. T-1`` (the reference forward).
            kv: the rows' key and value caches, each (B, num_heads, max_len, head_dim). The new keys and
                values are written at ``positions``; attention reads cache positions ``0 .. span-1``, and
                a query at position ``p`` sees the keys at positions ``<= p``.
            span: how many cache positions attention reads (default ``max_len``); it must exceed every
                position. A fixed span gives the step static shapes; what lies past a row's own positions
                is masked and must be finite (a NaN key still makes a NaN score, and a NaN value times a
                weight of 0 is NaN; :meth:`model.KVCache.clear` zeroes a slot).
            segments: packed prompts (B = 1, with ``kv`` the whole cache): ``(slot, length)`` pairs, in
                order along T, each a prompt from position 0 into its slot. Every segment attends over its
                own slot alone, with a span of its length, exactly as that prompt alone would (the same
                shapes); positions past the last segment are padding and attend to nothing (their output
                is zeros). The projections run once over all positions.
            shared: with ``kv`` and no ``segments``, :meth:`shared` of ``positions``, ``span`` and the cache's
                dtype, made once for every layer by the caller (default: made here).

        Returns:
            Tensor of shape (B, T, d_out).
        """
        b, t, _ = x.shape
        q, k, v = self._qkv(x)
        if kv is None:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=~self._blocked(t), dropout_p=self.dropout if self.training else 0.0
            )  # (B, nh, T, hs), scaled by 1/sqrt(hs)
            return self.c_proj(y.transpose(1, 2).reshape(b, t, self.d_out))
        if positions is None:
            raise ValueError("attention over a KV cache needs the positions of the new tokens")
        if segments is None:
            y = self._cached(q, k, v, positions, kv, span, shared)
        else:
            y = torch.zeros_like(q)  # padding positions stay 0
            start = 0
            for slot, length in segments:
                part = slice(start, start + length)
                slot_kv = (kv[0][slot : slot + 1], kv[1][slot : slot + 1])
                y[:, :, part] = self._cached(
                    q[:, :, part], k[:, :, part], v[:, :, part], positions[:, part], slot_kv, length
                )
                start += length
        return self.c_proj(y.transpose(1, 2).reshape(b, t, self.d_out))

    def shared(self, positions: torch.Tensor, span: int, dtype: torch.dtype, at: int | None = None) -> Shared:
        """What every layer of one cached call over ``span`` positions of a ``dtype`` cache shares, made once
        by the caller (see :class:`Shared`); ``at``: the one position every row writes, where the caller
        knows there is one."""
        b, t = positions.shape
        rows = torch.arange(b, device=positions.device)[:, None]
        blocked = torch.arange(span, device=positions.device) > positions[:, None, :, None]
        bias = None
        if t == 1:  # a decode step's additive mask in its working dtype, one row per head (for baddbmm)
            work = torch.promote_types(dtype, torch.float32)
            bias = torch.zeros(b, self.num_heads, 1, span, dtype=work, device=positions.device)
            bias.masked_fill_(blocked, float("-inf"))
        return Shared(rows, blocked, bias, at)

    def _cached(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        span: int | None,
        shared: Shared | None = None,
    ) -> torch.Tensor:
        """Write k and v at their rows' positions, attend q over the cache: (B, nh, T, hs)."""
        k_buf, v_buf = kv
        span = k_buf.shape[2] if span is None else span
        if shared is None:
            shared = self.shared(positions, span, k_buf.dtype)
        if shared.at is not None:  # one position for every row: a copy into a view (2.4 us, not 5.2)
            k_buf.narrow(2, shared.at, 1).copy_(k)
            v_buf.narrow(2, shared.at, 1).copy_(v)
        else:
            # k_buf[rows, :, positions] is (B, T, nh, hs): the advanced indices come first. (A scatter_ of
            # the same writes copied the whole non-contiguous span in and out: 1.7 ms at 8 rows x 1,024.)
            k_buf[shared.rows, :, positions] = k.transpose(1, 2)
            v_buf[shared.rows, :, positions] = v.transpose(1, 2)
        keys, values = k_buf.narrow(2, 0, span), v_buf.narrow(2, 0, span)
        if shared.bias is None:
            return self._attend(q, keys, values, shared.blocked, v_buf.dtype)
        # Written out rather than SDPA: for a few queries over many keys, CPU SDPA's bf16 kernel took 5-6x
        # as long (GPT-2 124M, 8 rows x 256 positions: 1.45 ms a layer against 0.25). A decode step's single
        # query per row runs its products in fp32 on upcast keys and values, as SDPA's kernels compute: stock
        # bf16 bmm of these shapes is slow (Zen 4, scores of 1 row x 64 positions 33 us against fp32's 8; 8
        # rows x 1,024 2.8 ms against 0.35), and a layer's attention took 52 us instead of 109 at 1 row x 64
        # positions, 2.9 ms instead of 4.0 at 8 rows x 1,024. A prompt's many queries run them in the cache's
        # dtype, where native bf16 is the faster (a 512-token prompt's, all 12 layers: 47 ms in bf16 against
        # 122 in fp32), with the softmax in fp32: their scores are rounded to 16 bits once more than SDPA's.
        # (Where bf16 is emulated, the runner's upcast mode runs those products in fp32: generate/kernels.py.)
        work = shared.bias.dtype
        if torch.compiler.is_compiling():  # the mask as masked_fill, which inductor fuses with the softmax
            # (a compiled int8 step at batch 1 took 4% longer with the baddbmm of the eager step)
            return self._attend(q, keys.to(work), values.to(work), shared.blocked, v_buf.dtype)
        b = q.shape[0]
        if work != k_buf.dtype:
            rows = max(1, ROW_PIECE_BYTES // (math.prod(keys.shape[1:]) * work.itemsize))
            if rows < b:
                pieces = (slice(r, r + rows) for r in range(0, b, rows))
                return torch.cat([self._attend_one(q[p], keys[p], values[p], shared.bias[p]) for p in pieces])
        return self._attend_one(q, keys, values, shared.bias)

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        blocked: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Softmax attention of q over keys and values with ``blocked`` masked: the products in the keys'
        dtype (from a query scaled first, so fp16 scores do not overflow where unscaled ones would), the
        softmax in at least fp32; (B, nh, T, hs) in ``dtype``."""
        q = q.to(keys.dtype) * (1.0 / math.sqrt(self.head_dim))
        scores = q @ keys.transpose(-2, -1)  # (B, nh, T, span)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        weights = torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)
        del scores  # (three (B, nh, T, span) fp32 tensors at most, as the engine's memory check counts)
        return (weights.to(values.dtype) @ values).to(dtype)  # (B, nh, T, hs)

    def _attend_one(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """A decode step's attention (one query per row) in ``bias``'s dtype: scores ``q . k / sqrt(hs) +
        bias`` in one ``baddbmm`` batched over rows x heads, the softmax, the weighted values; (B, nh, 1,
        hs) in the keys' dtype. Three-dimensional products keep the step's operator count low: an eager
        step at batch 1 is bound by per-operator overhead as much as by its kernels."""
        b, nh, t, hs = q.shape
        work = bias.dtype
        scores = torch.baddbmm(
            bias.view(b * nh, t, -1),
            q.to(work).reshape(b * nh, t, hs),
            keys.to(work).reshape(b * nh, -1, hs).transpose(1, 2),
            alpha=1.0 / math.sqrt(hs),
        )  # (B * nh, 1, span); a blocked key's -inf bias gives it a weight of exactly 0
        weights = torch.softmax(scores, dim=-1)
        out = torch.bmm(weights, values.to(work).reshape(b * nh, -1, hs))
        return out.view(b, nh, t, hs).to(keys.dtype)


class Shared(NamedTuple):
    """What every layer of one cached call shares (the same positions and span), made once by
    :meth:`CausalAttention.shared`.

    Attributes:
        rows: (B, 1) each row's index, so that a row writes its keys and values only in its own cache.
        blocked: (B, 1, T, span) True where a key's position is past the query's.
        bias: for a decode step (T = 1), ``blocked`` as an additive mask (0 or ``-inf``) of shape (B, nh, 1,
            span) in the step's working dtype (at least fp32); None for a longer call. The eager step adds
            it (so a non-finite key past a row's position would reach the row: the engine keeps them
            zero); a compiled step and a prompt mask with ``masked_fill`` on ``blocked``.
        at: the position every row writes its one new token at, where the caller read the positions and
            found one (an eager decode step at batch 1): the writes are then copies into a view of the cache
            rather than indexed writes. None: indexed writes at ``positions``.
    """

    rows: torch.Tensor
    blocked: torch.Tensor
    bias: torch.Tensor | None
    at: int | None = None
