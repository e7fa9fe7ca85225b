"""Linear: row-block products, a column-major head, oneDNN products and upcast bf16 products change no result
beyond rounding; each product takes the route meant for it; training stays in F.linear."""

import pytest
import torch
import torch.nn.functional as F

import checkpoints
import model.linear
from conftest import make_model
from model import GPTConfig
from model.linear import (
    BLOCKED_MAX_ROWS,
    ONEDNN_MAX_ROWS,
    UPCAST_MIN_ROWS,
    Linear,
    TiedEmbedding,
    _blocked_linear,
    _onednn_works,
    _row_blocks,
    linear,
)


def _onednn_calls(monkeypatch):
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def _linear_pointwise(self, x, weight, *args):
            calls.append((tuple(x.shape), weight.dtype))
            return real(x, weight, *args)

    monkeypatch.setattr(torch.ops, "mkldnn", Spy())
    return calls


def _blocked_calls(monkeypatch, threads: int):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # what _row_blocks reads
    calls = []
    real = model.linear._blocked_linear

    def spy(x, weight, bias, blocks):
        calls.append((tuple(x.shape), blocks))
        return real(x, weight, bias, blocks)

    monkeypatch.setattr(model.linear, "_blocked_linear", spy)
    return calls


@pytest.mark.parametrize("blocks", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [1, 3, 8, BLOCKED_MAX_ROWS])
def test_row_block_product_equals_plain_product(blocks, rows):
    torch.manual_seed(0)
    w, b = torch.randn(1200, 96), torch.randn(1200)
    for x in (torch.randn(rows, 96), torch.randn(2, rows, 96), torch.randn(rows, 2, 96).transpose(0, 1)):
        with torch.no_grad():
            for bias in (b, None):
                got = _blocked_linear(x, w, bias, blocks)
                assert got.shape == (*x.shape[:-1], 1200)
                # The same dot products summed in another order: values of size ~10 agree to ~1e-6.
                torch.testing.assert_close(got, F.linear(x, w, bias), atol=1e-4, rtol=0)


def test_row_blocks_are_one_per_thread_where_the_threads_divide_the_rows(monkeypatch):
    w = torch.randn(1200, 96)
    for threads, expected in [(1, 0), (2, 2), (4, 4), (7, 0), (16, 16)]:  # 1200 = 16 x 75; 7 does not divide
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        assert _row_blocks(w) == expected, threads
    assert _row_blocks(w.t().contiguous().t()) == 0  # column-major: the blocks would not be contiguous


@pytest.mark.skipif(not _onednn_works(), reason="this PyTorch build has no oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 8, ONEDNN_MAX_ROWS])
def test_onednn_product_equals_plain_product_in_every_layout(rows, monkeypatch):
    monkeypatch.setattr(model.linear, "_row_blocks", lambda weight: 0)  # whatever the thread count
    calls = _onednn_calls(monkeypatch)
    torch.manual_seed(0)
    w, b = torch.randn(1000, 96), torch.randn(1000)
    for weight in (w, w.t().contiguous().t()):  # row- and column-major
        for x in (torch.randn(rows, 96), torch.randn(2, rows, 96), torch.randn(rows, 2, 96).transpose(0, 1)):
            with torch.no_grad():
                # The same dot products summed in another order: values of size ~10 agree to ~1e-6.
                assert torch.allclose(linear(x, weight, b), F.linear(x, w, b), atol=1e-4, rtol=0)
                assert torch.allclose(linear(x, weight), F.linear(x, w), atol=1e-4, rtol=0)
    # 2 layouts x 2 calls for each input of at most ONEDNN_MAX_ROWS rows; longer ones go to MKL
    assert len(calls) == 2 * 2 * sum(n <= ONEDNN_MAX_ROWS for n in (rows, 2 * rows, 2 * rows))


@pytest.mark.skipif(not _onednn_works(), reason="this PyTorch build has no oneDNN")
def test_each_fp32_product_takes_its_route(monkeypatch):
    onednn, blocked = _onednn_calls(monkeypatch), _blocked_calls(monkeypatch, threads=2)
    layer, odd, head = Linear(64, 512), Linear(64, 511), TiedEmbedding(1024, 64)
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        layer(x)  # row blocks, one per thread
        odd(x)  # 511 rows do not split in 2: oneDNN
        head.project(x)  # column-major: oneDNN
        layer.to(torch.bfloat16)(x.bfloat16())  # bf16: F.linear (oneDNN bf16 needs native bf16 here)
    y = layer.float()(x)  # with gradients: training stays in autograd's F.linear
    assert y.requires_grad and y.grad_fn is not None
    with torch.inference_mode():  # what generation runs under
        assert not layer(torch.randn(1, 5, 64)).requires_grad
        layer(torch.randn(2, BLOCKED_MAX_ROWS // 2, 64))  # a short prompt: still row blocks
        layer(torch.randn(1, BLOCKED_MAX_ROWS + 1, 64))  # a long prompt: MKL (as fast there, and simpler)
        odd(torch.randn(1, ONEDNN_MAX_ROWS + 1, 64))  # past oneDNN's rows: MKL
    assert blocked == [((1, 1, 64), 2), ((1, 5, 64), 2), ((2, BLOCKED_MAX_ROWS // 2, 64), 2)]
    assert onednn == [((1, 1, 64), torch.float32), ((1, 1, 64), torch.float32)]


def test_without_onednn_products_fall_back_to_f_linear(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    monkeypatch.setattr(model.linear, "_row_blocks", lambda weight: 0)  # whatever the thread count
    calls = _onednn_calls(monkeypatch)
    layer = Linear(64, 512)
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == []


def is_column_major(w):
    return w.t().is_contiguous() and not w.is_contiguous()


def test_the_fp32_head_is_stored_column_major_with_unchanged_shape_and_products():
    torch.manual_seed(0)
    wide, narrow, head = Linear(64, 192), Linear(256, 64), TiedEmbedding(1000, 64)
    assert wide.weight.is_contiguous() and narrow.weight.is_contiguous()  # row-major, as row blocks need
    assert is_column_major(head.weight) and head.weight.shape == (1000, 64)
    x, ids = torch.randn(3, 64), torch.tensor([[0, 999, 5]])
    with torch.no_grad():
        plain = head.weight.contiguous()
        assert torch.equal(head(ids), F.embedding(ids, plain))
        # The same sums in another order: logits of size ~20 (N(0, 1) embeddings) may differ in the last bits.
        assert torch.allclose(head.project(x), F.linear(x, plain), atol=1e-4, rtol=0)


def test_casting_picks_the_head_layout_of_the_new_dtype_and_keeps_the_parameter():
    head = TiedEmbedding(1000, 64)
    weight = head.weight
    values = weight.detach().clone()
    head.to(torch.bfloat16)  # bf16 products read a row-major weight ~16x faster here
    assert head.weight is weight and weight.is_contiguous()
    head.float()
    assert head.weight is weight and is_column_major(weight)
    assert torch.equal(weight.detach(), values.bfloat16().float())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loading_gives_each_dtype_its_layout(tmp_path, dtype):
    model = make_model(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=300, n_positions=16))
    checkpoints.save(model, tmp_path)
    loaded = checkpoints.load(tmp_path, dtype=dtype)  # built on the meta device, then filled in place
    head = loaded.wte.weight
    assert is_column_major(head) if dtype == "float32" else head.is_contiguous()
    assert all(m.weight.is_contiguous() for m in loaded.modules() if isinstance(m, Linear))  # row-major
    for name, p in loaded.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[name].to(p.dtype)), name


def _upcast_calls(monkeypatch, emulated: bool):
    monkeypatch.setattr(model.linear, "_bf16_emulated", lambda: emulated)
    monkeypatch.setattr(model.linear, "UPCAST_CHUNK_BYTES", 4 * 96 * 128)  # 128 output rows a piece
    calls = []
    real = model.linear._upcast_linear

    def spy(x, weight, bias):
        calls.append(tuple(x.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(model.linear, "_upcast_linear", spy)
    return calls


@pytest.mark.parametrize("rows", [UPCAST_MIN_ROWS, 40])
def test_upcast_bf16_product_equals_the_fp32_product_rounded_to_bf16(monkeypatch, rows):
    calls = _upcast_calls(monkeypatch, emulated=True)
    torch.manual_seed(0)
    w, b = torch.randn(1000, 96).bfloat16(), torch.randn(1000).bfloat16()  # 1000 rows: 8 pieces
    for x in (torch.randn(rows, 96).bfloat16(), torch.randn(2, rows // 2, 96).bfloat16()):
        with torch.no_grad():
            for bias in (b, None):
                got = linear(x, w, bias)
                exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                assert got.dtype == torch.bfloat16 and got.shape == exact.shape
                # fp32 sums in another order, then one rounding to bf16 (8 significant bits): at most one
                # bf16 step (2**-7 relative) from the exact value rounded.
                torch.testing.assert_close(got.double(), exact.bfloat16().double(), rtol=2**-7, atol=1e-6)
    assert len(calls) == 4


def test_only_many_row_bf16_inference_products_are_upcast(monkeypatch):
    calls = _upcast_calls(monkeypatch, emulated=True)
    layer = Linear(96, 300).to(torch.bfloat16)
    many, few = torch.randn(UPCAST_MIN_ROWS, 96).bfloat16(), torch.randn(UPCAST_MIN_ROWS - 1, 96).bfloat16()
    with torch.no_grad():
        layer(many)
        layer(few)  # few rows: the emulated bf16 product, faster than a copy of the weight
    assert layer(many).requires_grad  # training keeps autograd's F.linear (no fp32 weight copies saved)
    monkeypatch.setattr(model.linear, "_bf16_emulated", lambda: False)
    with torch.no_grad():
        layer(many)  # native bf16: no copy
    assert calls == [(UPCAST_MIN_ROWS, 96)]
