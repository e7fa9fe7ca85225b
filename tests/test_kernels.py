"""Eager kernel routes (generate/kernels.py): oneDNN's fp32 inner product, products in row blocks and bf16
products upcast to fp32 stand in for F.linear only where they are asked to, compute the same product (within
a tolerance), and give a row the same bits wherever it stands among the rows."""

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_CONFIGS, make_model
from generate.kernels import (
    OneDNNLinear,
    Pieces,
    UpcastBF16,
    _BlockedLinearModule,
    _BlockedTiedEmbedding,
    _OneDNNLinearModule,
    _OneDNNTiedEmbedding,
    _upcast_linear,
    _UpcastLinearModule,
    _UpcastTiedEmbedding,
    blocked_linear,
    blocked_product,
    decode_copy,
    onednn_available,
)
from generate.probes import _same_in_every_position
from model import KVCache
from model.embedding import TiedEmbedding

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_onednn_linear_equals_f_linear_within_1e_5(rows):
    torch.manual_seed(0)
    x, w, b = torch.randn(rows, 2, 48), torch.randn(96, 48), torch.randn(96)
    with torch.inference_mode():
        want = F.linear(x, w, b)
        with OneDNNLinear():
            got = F.linear(x, w, b)
            no_bias = F.linear(x, w)
    assert got.shape == want.shape == (rows, 2, 96)
    assert (got - want).abs().max().item() <= 1e-5
    assert (no_bias - F.linear(x, w)).abs().max().item() <= 1e-5


@needs_onednn
def test_the_mode_leaves_other_dtypes_and_functions_alone():
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = F.linear(x, w)
        with OneDNNLinear():
            assert torch.equal(F.linear(x, w), want)  # bf16: F.linear itself, bitwise
            assert torch.equal(torch.add(x, x), x + x)


@needs_onednn
def test_a_model_forward_under_the_mode_matches_the_reference():
    model = make_model(TINY_CONFIGS["5x3x48"], seed=1, std=0.1)
    ids = torch.randint(0, 97, (2, 9))
    with torch.inference_mode():
        want = model(ids)
        with OneDNNLinear():
            got = model(ids)
    assert (got - want).abs().max().item() <= 1e-5


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_copy_on_onednn_computes_what_the_mode_does_bitwise_and_shares_the_weights(dtype):
    # The eager decode step's oneDNN route is a copy of the model's modules (no mode on every torch call):
    # a cached forward through it gives the mode's bits; it leaves bf16 products to F.linear and the model
    # itself as it was.
    model = make_model(TINY_CONFIGS["5x3x48"], seed=1, std=0.1).to(dtype)
    routed = decode_copy(model, onednn=True)
    assert type(routed.h[0].mlp.c_fc) is _OneDNNLinearModule and type(routed.wte) is _OneDNNTiedEmbedding
    assert all(a is b for a, b in zip(model.parameters(), routed.parameters(), strict=True))
    assert type(model.h[0].mlp.c_fc) is torch.nn.Linear and type(model.wte) is TiedEmbedding
    ids, positions = torch.randint(0, 97, (3, 1)), torch.tensor([[4], [0], [9]])
    with torch.inference_mode():
        caches = [KVCache(model.config, 3, 16, dtype=dtype) for _ in range(3)]
        for cache in caches:
            for buffer in (*cache.k, *cache.v):  # the same earlier positions for every route
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(2)))
        with OneDNNLinear():
            by_mode = model(ids, positions=positions, cache=caches[0], span=16)
        by_copy = routed(ids, positions=positions, cache=caches[1], span=16)
        plain = model(ids, positions=positions, cache=caches[2], span=16)
    assert torch.equal(by_copy, by_mode)
    assert (by_copy.float() - plain.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 0)
    assert torch.equal(caches[1].k[3], caches[0].k[3])


@pytest.mark.parametrize(("out_features", "blocks"), [(96, 4), (97, 4), (211, 8), (5, 2)])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_product_in_row_blocks_equals_f_linear_within_1e_5(out_features, blocks, rows):
    # Rows past whole blocks (97 = 4 x 24 + 1) come from the last block, which overlaps the one before it;
    # the result is contiguous.
    torch.manual_seed(0)
    x, w = torch.randn(rows, 1, 48), torch.randn(out_features, 48)
    with torch.inference_mode():
        got = blocked_product(x, w, blocks)
    assert got.shape == (rows, 1, out_features) and got.is_contiguous()
    assert (got - F.linear(x, w)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("out_features", [96, 97, 99])
def test_a_row_in_row_blocks_gets_the_same_bits_in_any_position_beside_any_rows(out_features):
    # Batch invariance: at a fixed row count a row's bits do not depend on the other rows or its place
    # among them, rows past whole blocks (97 = 4 x 24 + 1) included. F.linear with one weight row failed it
    # on a Zen 4 (MKL summed a row in another order at another place), so those rows are not computed apart.
    torch.manual_seed(0)
    x, w = torch.randn(3, 1, 48), torch.randn(out_features, 48)
    with torch.inference_mode():
        assert _same_in_every_position(blocked_product, x, w, 4)
        for i in range(3):
            others = torch.randn(3, 1, 48)
            others[i] = x[0]
            assert torch.equal(blocked_product(others, w, 4)[i], blocked_product(x, w, 4)[0])


@pytest.mark.parametrize("onednn", [False, pytest.param(True, marks=needs_onednn)])
def test_the_decode_copy_with_head_blocks_routes_only_the_head_and_shares_the_weights(onednn):
    model = make_model(TINY_CONFIGS["5x3x48"], seed=1, std=0.1)
    routed = decode_copy(model, onednn=onednn, head_blocks=4)
    assert type(routed.wte) is _BlockedTiedEmbedding and routed.wte.blocks == 4
    assert type(routed.h[0].mlp.c_fc) is (_OneDNNLinearModule if onednn else torch.nn.Linear)
    assert all(a is b for a, b in zip(model.parameters(), routed.parameters(), strict=True))
    assert type(model.wte) is TiedEmbedding and not hasattr(model.wte, "blocks")
    ids, positions = torch.randint(0, 97, (3, 1)), torch.tensor([[4], [0], [9]])
    with torch.inference_mode():
        got = routed(ids, positions=positions, cache=KVCache(model.config, 3, 16), span=16)
        want = model(ids, positions=positions, cache=KVCache(model.config, 3, 16), span=16)
        hidden = torch.randn(3, 1, 48)
        assert torch.equal(routed.wte.project(hidden), blocked_product(hidden, model.wte.weight, 4))
        bf16 = decode_copy(model.to(torch.bfloat16), onednn=onednn, head_blocks=4)
        assert torch.equal(bf16.wte.project(hidden.bfloat16()), model.wte.project(hidden.bfloat16()))
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_linear_in_row_blocks_equals_f_linear_and_gives_a_row_the_same_bits_in_any_place(bias, rows):
    torch.manual_seed(0)
    x, w, b = torch.randn(rows, 1, 48), torch.randn(96, 48), torch.randn(96) if bias else None
    with torch.inference_mode():
        got = blocked_linear(x, w, b, 4)
        assert got.shape == (rows, 1, 96) and (got - F.linear(x, w, b)).abs().max().item() <= 1e-5
        assert _same_in_every_position(blocked_linear, x, w, b, 4)


@pytest.mark.parametrize("onednn", [False, pytest.param(True, marks=needs_onednn)])
def test_the_decode_copy_with_body_blocks_takes_the_layers_they_divide_and_leaves_the_rest(onednn):
    model = make_model(TINY_CONFIGS["5x3x48"], seed=1, std=0.1)  # outputs 144, 48, 192, 48: 3 divides all
    routed = decode_copy(model, onednn=onednn, body_blocks=3)
    layer = routed.h[0].mlp.c_fc
    assert type(layer) is _BlockedLinearModule and (layer.blocks, layer.onednn) == (3, onednn)
    assert type(routed.wte) is (_OneDNNTiedEmbedding if onednn else TiedEmbedding)
    assert all(a is b for a, b in zip(model.parameters(), routed.parameters(), strict=True))
    x = torch.randn(2, 1, 48)
    with torch.inference_mode():
        assert torch.equal(layer(x), blocked_linear(x, layer.weight, layer.bias, 3))
        layer.blocks = 5  # 192 outputs: 5 does not divide them, so the layer's other kernel
        other = (
            torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
            if onednn
            else None
        )
        assert torch.equal(layer(x), other if onednn else F.linear(x, layer.weight, layer.bias))
        ids, positions = torch.randint(0, 97, (3, 1)), torch.tensor([[4], [0], [9]])
        got = routed(ids, positions=positions, cache=KVCache(model.config, 3, 16), span=16)
        want = model(ids, positions=positions, cache=KVCache(model.config, 3, 16), span=16)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_upcast_products_equal_fp32_products_rounded_to_bf16(rows, monkeypatch):
    import generate.kernels as kernels

    monkeypatch.setattr(kernels, "UPCAST_CHUNK_BYTES", 4 * 48 * 7)  # 7 weight rows a piece: 14 pieces
    torch.manual_seed(0)
    x = torch.randn(rows, 48, dtype=torch.bfloat16)
    w, b = torch.randn(96, 48, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
        with UpcastBF16(min_rows=5):
            got = F.linear(x, w, b)
        plain = F.linear(x, w, b)
    if rows >= 5:
        assert got.dtype == torch.bfloat16 and (got.float() - want.float()).abs().max().item() <= 1e-2
    else:
        assert torch.equal(got, plain)  # below min_rows: F.linear itself


@pytest.mark.parametrize("queries", [1, 5, 9])
def test_upcast_attention_products_equal_fp32_products_rounded_to_bf16(queries, monkeypatch):
    # A prompt's attention products (``@`` and torch.matmul of bf16 tensors, 4-d as in model/attention.py):
    # from min_rows query rows they run in fp32 and are rounded once, else as they are.
    import generate.kernels as kernels

    upcast, real = [], kernels._upcast_matmul
    monkeypatch.setattr(kernels, "_upcast_matmul", lambda x, y: upcast.append(1) or real(x, y))
    torch.manual_seed(0)
    q = torch.randn(2, 3, queries, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 3, 9, 64, dtype=torch.bfloat16), torch.randn(2, 3, 9, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        with UpcastBF16(min_rows=5):
            scores = q @ k.transpose(-2, -1)
            out = torch.matmul(scores, v)
            fp32_alone = q.float() @ k.float().transpose(-2, -1)  # fp32 operands: never touched
        plain = q @ k.transpose(-2, -1)
    assert scores.dtype == out.dtype == torch.bfloat16 and fp32_alone.dtype == torch.float32
    if queries >= 5:
        assert len(upcast) == 2
        assert torch.equal(scores, (q.float() @ k.float().transpose(-2, -1)).to(torch.bfloat16))
        assert torch.equal(out, (scores.float() @ v.float()).to(torch.bfloat16))
    else:
        assert not upcast and torch.equal(scores, plain)  # below min_rows: the bf16 product itself


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_upcast_products_in_row_blocks_equal_fp32_products_and_keep_a_rows_bits(rows, bias, monkeypatch):
    # The decode step's upcast route, in pieces of 7 weight rows' bytes into one buffer. 101 rows: with 2 or
    # 3 blocks, pieces of 6 rows (whole blocks) and a last one of 5 (blocked_product's overlapping blocks, as
    # GPT-2's head's last piece); with 5, pieces of 5 rows and a last one of 1 (a block of one row).
    import generate.kernels as kernels

    monkeypatch.setattr(kernels, "UPCAST_CHUNK_BYTES", 4 * 48 * 7)  # (fresh pieces: the same rows)
    torch.manual_seed(0)
    x = torch.randn(rows, 1, 48, dtype=torch.bfloat16)
    w = torch.randn(101, 48, dtype=torch.bfloat16)
    b = torch.randn(101, dtype=torch.bfloat16) if bias else None
    with torch.inference_mode():
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        for blocks in (2, 3, 5):
            pieces = Pieces(4 * 48 * 7)
            got = _upcast_linear(x, w, b, blocks, pieces)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, 1, 101)
            assert (got.float() - want).abs().max().item() <= 2**-7 * want.abs().max().item()  # 1 bf16 ulp
            assert torch.equal(got, _upcast_linear(x, w, b, blocks))  # fresh pieces: the same bits
            assert torch.equal(got, piece_by_piece(x, w, b, blocks, max(blocks, 7 // blocks * blocks)))
            assert torch.equal(_upcast_linear(x[:, 0], w, b, blocks, pieces), got[:, 0])  # (rows, in) too
            assert pieces._buffer is not None and pieces._buffer.numel() == 48 * 7
            assert _same_in_every_position(_upcast_linear, x, w, b, blocks, pieces)


def piece_by_piece(x, w, b, blocks, rows):
    """The upcast route's product as blocked_linear (or, for a piece whose rows the blocks do not divide,
    blocked_product) of each piece of ``rows`` weight rows upcast, put together and rounded to bf16: what
    the route computes, spelt out."""
    x32, outs = x.float(), []
    for a in range(0, len(w), rows):
        piece, bias = w[a : a + rows].float(), None if b is None else b[a : a + rows].float()
        if len(piece) % blocks == 0:
            outs.append(blocked_linear(x32, piece, bias, blocks))
        else:
            y = blocked_product(x32, piece, min(blocks, len(piece)))
            outs.append(y if bias is None else y + bias)
    return torch.cat(outs, -1).to(torch.bfloat16)


def test_the_decode_copy_with_upcast_blocks_routes_bf16_products_and_shares_the_weights(monkeypatch):
    # (Native bf16 products also sum in fp32 and round once, so equal outputs alone would not show the route.)
    import generate.kernels as kernels

    model = make_model(TINY_CONFIGS["5x3x48"], seed=1, std=0.1).to(torch.bfloat16)
    with pytest.raises(ValueError, match="upcast_pieces"):
        decode_copy(model, onednn=False, upcast_blocks=2)  # no piece size
    routed = decode_copy(model, onednn=False, upcast_blocks=2, upcast_pieces=4 * 48 * 10)
    layers = [m for m in routed.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(type(m) is _UpcastLinearModule and m.blocks == 2 for m in layers)
    assert type(routed.wte) is _UpcastTiedEmbedding and routed.wte.blocks == 2
    assert len({id(m.pieces) for m in [*layers, routed.wte]}) == 1  # one buffer for every product
    assert routed.wte.pieces.nbytes == 4 * 48 * 10
    assert all(a is b for a, b in zip(model.parameters(), routed.parameters(), strict=True))
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    calls, real = [], kernels._upcast_linear
    monkeypatch.setattr(
        kernels,
        "_upcast_linear",
        lambda x, w, b, blocks, pieces: calls.append((w, blocks, pieces)) or real(x, w, b, blocks, pieces),
    )
    ids, positions = torch.randint(0, 97, (3, 1)), torch.tensor([[4], [0], [9]])
    with torch.inference_mode():
        got = routed(
            ids, positions=positions, cache=KVCache(model.config, 3, 16, dtype=torch.bfloat16), span=16
        )
        want = model.float()(ids, positions=positions, cache=KVCache(model.config, 3, 16), span=16)
    routed_weights = {id(m.weight) for m in [*layers, routed.wte]}
    assert {id(w) for w, _, _ in calls} == routed_weights  # every product of the step on the route
    assert all(blocks == 2 and pieces is routed.wte.pieces for _, blocks, pieces in calls)
    assert (got.float() - want).abs().max().item() <= 0.05  # bf16 activations, fp32 products


@needs_onednn
def test_the_mode_routes_a_model_forward_through_onednn(monkeypatch):
    # On tiny shapes oneDNN and F.linear can agree bitwise, so equal outputs alone would not show the route.
    import generate.kernels as kernels

    calls = []
    real = kernels._onednn_linear

    def spy(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(kernels, "_onednn_linear", spy)
    config = TINY_CONFIGS["5x3x48"]
    model = make_model(config, seed=1)
    with torch.inference_mode(), OneDNNLinear():
        model(torch.randint(0, config.vocab_size, (2, 5)))
    assert len(calls) == 4 * config.n_layer + 1  # qkv, attention out, MLP in and out per block, the head
    assert calls[-1] == (config.vocab_size, config.n_embd)
