"""Int4 weight-only quantization: 4-bit codes in groups along each row, a bf16 scale and zero per group.

Codes 0..15 stand for ``(code - 8) * scale + zero``, as in stock PyTorch's int4 kernels (CPU
``aten._weight_int4pack_mm_for_cpu``, CUDA ``aten._weight_int4pack_mm``), each with its own packing; rows
padded with zero rows to whole :data:`ROW_BLOCK`, the extra outputs sliced off. From :data:`DEQUANT_ROWS`
input rows an eager CPU product turns blocks of weight rows into bf16 (rounded once) for a bf16 product: the
way follows from shapes. The tied embedding also keeps its codes plainly, for a lookup of its rows."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from model.quant import COMPUTE_DTYPE, as_rows, quantize_child, quantize_model

GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
ROW_BLOCK = 64  # rows pad to a multiple of this (the CPU packing's row block; CUDA's: 8), packed in passes
WEIGHTS_PER_PASS = 2**20  # quantized or packed per pass: bounds the temporaries (4 MiB each) while loading
INNER_K_TILES = 8  # CUDA's packing parameter (fewer for widths not multiples of 16 * 8); the CPU ignores it
DEQUANT_ROWS = 256  # input rows from which a CPU product runs in bf16 (about where both ways cost the same)


def check_group_size(group_size: int, *widths: int) -> None:
    """ValueError unless ``group_size`` is in GROUP_SIZES and divides the widths (torch<2.6: RuntimeError)."""
    if type(group_size) is not int or group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"):  # (new in torch 2.6)
        raise RuntimeError(f"int4 needs torch 2.6 or newer, not {torch.__version__}; pip install torch==2.13")
    if bad := [width for width in widths if width % group_size]:
        fits = " or ".join(str(g) for g in GROUP_SIZES if all(width % g == 0 for width in widths))
        fix = f"use group_size {fits}" if fits else f"no int4 group size {GROUP_SIZES} divides it: use int8"
        raise ValueError(f"int4 with group_size {group_size} needs every linear layer's input width to be a "
                         f"multiple of it, but this model has one of width {bad[0]}; {fix}")  # fmt: skip


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes per group of ``group_size`` columns: ``(codes, scales_zeros)``, uint8 (N, K / 2)
    two a byte (even column in the low nibble), and bf16 (K / group_size, N, 2), the kernels' layout. Codes
    are chosen against scale and zero rounded to bf16; rows are independent (row pieces quantize alike)."""
    n, k = weight.shape
    check_group_size(group_size, k)
    codes = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scales_zeros = torch.empty(k // group_size, n, 2, dtype=COMPUTE_DTYPE, device=weight.device)
    step = _rows_per_pass(k)
    for start in range(0, n, step):
        rows = slice(start, start + step)
        w = weight[rows].detach().float().view(-1, k // group_size, group_size)  # (n', G, g)
        low, high = w.aminmax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12).to(COMPUTE_DTYPE).float()  # (n', G)
        zero = (low + 8 * scale).to(COMPUTE_DTYPE).float()
        q = w - zero[..., None]  # one temporary, then in place
        q = q.div_(scale[..., None]).add_(8).round_().clamp_(0, 15).to(torch.uint8).view(-1, k)
        codes[rows] = q[:, 0::2] | (q[:, 1::2] << 4)
        scales_zeros[:, rows] = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(COMPUTE_DTYPE)
    return codes, scales_zeros


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes two to a byte, (..., K / 2) uint8 -> one a byte, (..., K) uint8."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)


def _padded(rows: int) -> int:
    return -(-rows // ROW_BLOCK) * ROW_BLOCK


def _rows_per_pass(width: int) -> int:
    return max(ROW_BLOCK, WEIGHTS_PER_PASS // width // ROW_BLOCK * ROW_BLOCK)


def _pack_piece(piece: torch.Tensor) -> torch.Tensor:
    if piece.device.type == "cuda":  # CUDA's packing takes the even column in the high nibble
        width = 2 * piece.shape[1]  # a multiple of 16 * tiles (the group size, 32 or more, divides it)
        # The product reads the tile count back from the packed shape.
        tiles = next(t for t in (INNER_K_TILES, 4, 2) if width % (16 * t) == 0)
        return torch.ops.aten._convert_weight_to_int4pack((piece << 4) | (piece >> 4), tiles)
    q = unpack_codes(piece).to(torch.int32)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """The kernel layout for ``codes`` (N, K / 2), rows padded with code 0 to whole :data:`ROW_BLOCK`, packed
    in passes of whole row blocks (both layouts keep a block's bytes together, in row order along dim 0)."""
    codes = F.pad(codes, (0, 0, 0, _padded(len(codes)) - len(codes)))
    step = _rows_per_pass(2 * codes.shape[1])
    return torch.cat([_pack_piece(codes[start : start + step]) for start in range(0, len(codes), step)])


def _pad_scales(scales_zeros: torch.Tensor) -> torch.Tensor:
    return F.pad(scales_zeros, (0, 0, 0, _padded(scales_zeros.shape[1]) - scales_zeros.shape[1]))


@functools.cache
def _cpu_layout() -> tuple[int, slice, slice]:
    """The CPU packing's rows per block (by the CPU's vector width), and the block's rows that the low and
    the high nibbles of its bytes along a column hold: read off packing rows whose codes are their numbers."""

    def packed(codes: torch.Tensor) -> torch.Tensor:  # (ROW_BLOCK, 2) -> flat bytes, as pack() packs them
        return _pack_piece((codes[:, :1] | codes[:, 1:] << 4).to(torch.uint8)).flatten().long()

    rows = torch.arange(ROW_BLOCK)[:, None].expand(-1, 2)
    half = int(packed(torch.arange(2).expand(ROW_BLOCK, 2)).flatten().nonzero()[0])  # where column 1 starts
    low, high = (packed(digits).flatten()[:half] for digits in (rows % 16, rows // 16))
    low, high = (low & 15) + 16 * (high & 15), (low >> 4) + 16 * (high >> 4)
    return 2 * half, *(slice(int(r[0]), int(r[-1]) + 1, int(r[1] - r[0])) for r in (low, high))


def _dequantized_t(packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The CPU-packed rows given (whole blocks) as ``W.T`` in bf16, (K, rows): each ``(code - 8) * scale +
    zero`` computed in fp32 and rounded once."""
    block, low, high = _cpu_layout()
    k = 2 * packed.shape[1]
    p = packed.view(-1, k, block // 2).transpose(0, 1)  # (K, blocks, block / 2)
    q = torch.empty(k, p.shape[1], block, dtype=torch.uint8)
    q[..., low], q[..., high] = p & 15, p >> 4
    scale, zero = scales_zeros.float().unbind(-1)  # (G, rows) each
    w = torch.addcmul(zero[:, None], q.view(-1, group_size, scale.shape[1]).float().sub_(8), scale[:, None])
    return w.view(k, -1).to(COMPUTE_DTYPE)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor, n: int):
    """``x @ W.T`` for the int4 matrix W of ``n`` real rows: (..., K) -> (..., n), bf16."""
    rows = as_rows(x)
    if packed.device.type == "cpu" and rows.shape[0] >= DEQUANT_ROWS and not torch.compiler.is_compiling():
        step = _rows_per_pass(rows.shape[1])
        y = torch.cat([rows @ _dequantized_t(packed[b : b + step], group_size, scales_zeros[:, b : b + step])
                       for b in range(0, n, step)], dim=-1)  # fmt: skip
    else:
        ops = torch.ops.aten
        mm = ops._weight_int4pack_mm if packed.device.type == "cuda" else ops._weight_int4pack_mm_for_cpu
        y = mm(rows, packed, group_size, scales_zeros)
    return y[:, :n].reshape(*x.shape[:-1], n)


class Int4Linear(nn.Module):
    """A quantized ``nn.Linear`` from :func:`quantize_groups`' output for its weight (N, K), and its bias."""

    def __init__(self, codes: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> None:  # fmt: skip
        super().__init__()
        self.group_size, self.out_features = group_size, codes.shape[0]
        self.register_buffer("packed", pack(codes))
        self.register_buffer("scales_zeros", _pad_scales(scales_zeros))
        self.register_buffer("bias", None if bias is None else bias.detach().to(COMPUTE_DTYPE))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        """Quantize an ``nn.Linear``."""
        return cls(*quantize_groups(linear.weight, group_size), group_size, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int4_mm(x, self.packed, self.group_size, self.scales_zeros, self.out_features)
        return y if self.bias is None else y + self.bias


class Int4TiedEmbedding(nn.Module):
    """An int4 :class:`TiedEmbedding` from :func:`quantize_groups`' output; its head is :func:`int4_mm`."""

    def __init__(self, codes: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> None:
        super().__init__()
        self.group_size, self.vocab_size = group_size, codes.shape[0]
        self.register_buffer("codes", codes)
        self.register_buffer("packed", pack(codes))
        self.register_buffer("scales_zeros", _pad_scales(scales_zeros))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = unpack_codes(self.codes[ids]).to(COMPUTE_DTYPE)  # (..., C)
        s, z = self.scales_zeros[:, ids.reshape(-1)].permute(2, 1, 0)  # (rows, G) each
        q = q.view(s.shape[0], s.shape[1], -1)  # (rows, G, g)
        return ((q - 8) * s[..., None] + z[..., None]).view(*ids.shape, -1)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Logits, (..., n_embd) -> (..., vocab_size)."""
        return int4_mm(x, self.packed, self.group_size, self.scales_zeros, self.vocab_size)


def quantize_child_int4(parent: nn.Module, name: str, group_size: int, *, include_head: bool = True) -> bool:
    """:func:`model.quant.quantize_child` with int4 layers."""
    linear = lambda layer: Int4Linear.from_linear(layer, group_size)  # noqa: E731
    head = lambda weight: Int4TiedEmbedding(*quantize_groups(weight, group_size), group_size)  # noqa: E731
    return quantize_child(parent, name, include_head=include_head, linear=linear, head=head)


def quantize_int4(model: nn.Module, group_size: int = DEFAULT_GROUP_SIZE, *,
                  include_head: bool = True) -> nn.Module:  # fmt: skip
    """Quantize a GPT's linear layers (and with ``include_head`` its tied head) to int4 in place."""
    check_group_size(group_size)
    return quantize_model(model, quantize_child_int4, group_size=group_size, include_head=include_head)
