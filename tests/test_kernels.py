"""Eager kernel routes (generate/kernels.py): oneDNN's fp32 inner product stands in for F.linear only where
it is asked to, computes the same product, and is chosen by a measurement only for fp32 CPU models."""

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
    _same_in_every_position,
    _upcast_linear,
    _UpcastLinearModule,
    _UpcastTiedEmbedding,
    blocked_linear,
    blocked_product,
    body_blocks_fit,
    decode_copy,
    head_blocks_pays,
    onednn_available,
    onednn_pays,
    upcast_blocks_fit,
    upcast_min_rows,
)
from model import KVCache
from model.embedding import TiedEmbedding
from model.quant import quantize_int8

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


def test_the_position_check_finds_a_product_that_depends_on_a_rows_place():
    x, w = torch.randn(3, 1, 48), torch.randn(8, 48)
    shifted = lambda rows, w: F.linear(rows, w) + torch.arange(len(rows))[:, None, None] * 1e-3  # noqa: E731
    assert not _same_in_every_position(shifted, x, w)
    assert _same_in_every_position(shifted, x[:1], w)  # one row has one place


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


def test_head_blocks_are_measured_only_for_fp32_cpu_heads_and_chosen_by_the_clock(monkeypatch):
    import generate.kernels as kernels

    model = make_model(TINY_CONFIGS["5x3x48"], seed=1)
    assert head_blocks_pays(model.to(torch.bfloat16), 1, False) is None
    assert head_blocks_pays(quantize_int8(make_model(TINY_CONFIGS["5x3x48"], seed=1)), 1, False) is None
    model = make_model(TINY_CONFIGS["5x3x48"], seed=1)
    assert head_blocks_pays(model, 1, False) in (None, 2, 4, 8)  # whichever is faster on this machine
    timings = {2: 0.9, 4: 0.8, 8: 0.85, "other": 1.0}

    def clock(fn, x, weight, *blocks):
        return timings[blocks[0] if blocks else "other"]

    monkeypatch.setattr(kernels, "_best_of", clock)
    assert head_blocks_pays(model, 3, False) == 4  # the fastest, 20% faster
    monkeypatch.setattr(kernels, "_same_in_every_position", lambda *a: False)
    assert head_blocks_pays(model, 3, False) is None  # faster, but a row's bits would depend on its place
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "_best_of", clock)
    timings.update({2: 0.96, 4: 0.97, 8: 0.99})
    assert head_blocks_pays(model, 3, True) is None  # under 5% faster: the other route stays


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


def test_body_blocks_fit_only_fp32_cpu_layers_they_divide():
    model = make_model(TINY_CONFIGS["5x3x48"], seed=1)
    assert body_blocks_fit(model, 3, 2) and body_blocks_fit(model, 1, 3)
    assert not body_blocks_fit(model, 3, 1)  # one block is the product itself
    assert not body_blocks_fit(model, 3, 5)  # 5 divides none of 144, 48, 192
    assert not body_blocks_fit(quantize_int8(make_model(TINY_CONFIGS["5x3x48"], seed=1)), 3, 2)
    assert not body_blocks_fit(model.to(torch.bfloat16), 3, 2)


def test_only_fp32_cpu_models_are_measured():
    model = make_model(TINY_CONFIGS["5x3x48"], seed=1)
    assert isinstance(onednn_pays(model, 2), bool)  # whichever is faster on this machine
    assert onednn_pays(model.to(torch.bfloat16), 2) is False
    assert onednn_pays(quantize_int8(make_model(TINY_CONFIGS["5x3x48"], seed=1)), 2) is False


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
    # The decode step's upcast route, in pieces of 7 weight rows' bytes into one buffer: with 2 or 3 blocks,
    # pieces of 6 rows (whole blocks), which divide 96; with 5, pieces of 5 rows and a last one of 1 row
    # (blocked_product with one block).
    import generate.kernels as kernels

    monkeypatch.setattr(kernels, "UPCAST_CHUNK_BYTES", 4 * 48 * 7)  # (fresh pieces: the same rows)
    torch.manual_seed(0)
    x = torch.randn(rows, 1, 48, dtype=torch.bfloat16)
    w = torch.randn(96, 48, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    with torch.inference_mode():
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        for blocks in (2, 3, 5):
            pieces = Pieces(4 * 48 * 7)
            got = _upcast_linear(x, w, b, blocks, pieces)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, 1, 96)
            assert (got.float() - want).abs().max().item() <= 2**-7 * want.abs().max().item()  # 1 bf16 ulp
            assert torch.equal(got, _upcast_linear(x, w, b, blocks))  # fresh pieces: the same bits
            assert pieces._buffer is not None and pieces._buffer.numel() == 48 * 7
            assert _same_in_every_position(_upcast_linear, x, w, b, blocks, pieces)


def test_the_decode_copy_with_upcast_blocks_routes_bf16_products_and_shares_the_weights():
    model = make_model(TINY_CONFIGS["5x3x48"], seed=1, std=0.1).to(torch.bfloat16)
    routed = decode_copy(model, onednn=False, upcast_blocks=2)
    layers = [m for m in routed.modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(type(m) is _UpcastLinearModule and m.blocks == 2 for m in layers)
    assert type(routed.wte) is _UpcastTiedEmbedding and routed.wte.blocks == 2
    assert len({id(m.pieces) for m in [*layers, routed.wte]}) == 1  # one buffer for every product
    assert all(a is b for a, b in zip(model.parameters(), routed.parameters(), strict=True))
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    ids, positions = torch.randint(0, 97, (3, 1)), torch.tensor([[4], [0], [9]])
    with torch.inference_mode():
        got = routed(
            ids, positions=positions, cache=KVCache(model.config, 3, 16, dtype=torch.bfloat16), span=16
        )
        want = model.float()(ids, positions=positions, cache=KVCache(model.config, 3, 16), span=16)
        assert (got.float() - want).abs().max().item() <= 0.05  # bf16 activations, fp32 products
        assert torch.equal(layers[0](torch.ones(2, 48)), F.linear(torch.ones(2, 48), layers[0].weight.float(),
                                                                  layers[0].bias.float()))  # fmt: skip


def test_upcast_blocks_fit_only_dense_bf16_models_where_bf16_is_emulated(monkeypatch):
    import generate.kernels as kernels

    model = make_model(TINY_CONFIGS["5x3x48"], seed=1).to(torch.bfloat16)
    monkeypatch.setattr(kernels, "bf16_native", lambda: True)
    assert not upcast_blocks_fit(model, 3, 2)  # native bf16: its own products
    monkeypatch.setattr(kernels, "bf16_native", lambda: False)
    assert upcast_blocks_fit(model, 3, 2) and upcast_blocks_fit(model, 1, 2)
    assert not upcast_blocks_fit(model, 3, 1)  # one block is the product itself
    assert not upcast_blocks_fit(make_model(TINY_CONFIGS["5x3x48"], seed=1), 3, 2)  # fp32
    assert not upcast_blocks_fit(quantize_int8(make_model(TINY_CONFIGS["5x3x48"], seed=1)), 3, 2)
    monkeypatch.setattr(kernels, "_same_in_every_position", lambda *args: False)  # a row's bits moved
    assert not upcast_blocks_fit(model, 3, 2)


def test_upcast_is_measured_only_where_bf16_is_emulated(monkeypatch):
    import generate.kernels as kernels

    model = make_model(TINY_CONFIGS["5x3x48"], seed=1).to(torch.bfloat16)
    monkeypatch.setattr(kernels, "bf16_native", lambda: True)
    assert upcast_min_rows(model) is None
    monkeypatch.setattr(kernels, "bf16_native", lambda: False)
    rows = upcast_min_rows(model, candidates=(1, 8))
    assert rows in (None, 1, 8)  # whichever the measurement says here
    assert upcast_min_rows(make_model(TINY_CONFIGS["5x3x48"], seed=1), candidates=(1, 8)) is None  # fp32


@pytest.mark.parametrize(
    ("answers", "kept"), [((None, 8, 16), 16), ((8, None, 8), 8), ((None, 4, None), None), ((2, 2, 32), 2)]
)
def test_the_upcast_row_count_is_the_median_of_three_measurements(monkeypatch, answers, kept):
    # One measurement near a break-even can say None (never upcast), which would be kept for good.
    import generate.kernels as kernels

    monkeypatch.setattr(kernels, "bf16_native", lambda: False)
    script = iter(answers)
    monkeypatch.setattr(kernels, "_upcast_rows_once", lambda layers, candidates: next(script))
    model = make_model(TINY_CONFIGS["5x3x48"], seed=1).to(torch.bfloat16)
    assert upcast_min_rows(model) == kept
    assert next(script, "all used") == "all used"


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
