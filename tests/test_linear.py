"""Linear: column-major storage, oneDNN products and upcast bf16 products change no result beyond rounding;
training stays in F.linear."""

import pytest
import torch
import torch.nn.functional as F

import checkpoints
import model.linear
from conftest import make_model
from model import GPTConfig
from model.linear import ONEDNN_MAX_ROWS, UPCAST_MIN_ROWS, Linear, TiedEmbedding, _onednn_works, linear


def _onednn_calls(monkeypatch):
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def _linear_pointwise(self, x, weight, *args):
            calls.append((tuple(x.shape), weight.dtype))
            return real(x, weight, *args)

    monkeypatch.setattr(torch.ops, "mkldnn", Spy())
    return calls


@pytest.mark.skipif(not _onednn_works(), reason="this PyTorch build has no oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 8, 64])
def test_onednn_product_equals_plain_product_in_every_layout(rows):
    torch.manual_seed(0)
    w, b = torch.randn(1000, 96), torch.randn(1000)
    for weight in (w, w.t().contiguous().t()):  # row- and column-major
        for x in (torch.randn(rows, 96), torch.randn(2, rows, 96), torch.randn(rows, 2, 96).transpose(0, 1)):
            with torch.no_grad():
                # The same dot products summed in another order: values of size ~10 agree to ~1e-6.
                assert torch.allclose(linear(x, weight, b), F.linear(x, w, b), atol=1e-4, rtol=0)
                assert torch.allclose(linear(x, weight), F.linear(x, w), atol=1e-4, rtol=0)


@pytest.mark.skipif(not _onednn_works(), reason="this PyTorch build has no oneDNN")
def test_only_fp32_cpu_inference_products_go_to_onednn(monkeypatch):
    calls = _onednn_calls(monkeypatch)
    layer, head = Linear(64, 512), TiedEmbedding(1024, 64)
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        layer(x)
        head.project(x)
        layer.to(torch.bfloat16)(x.bfloat16())  # bf16: F.linear (oneDNN bf16 needs native bf16 here)
    y = layer.float()(x)  # with gradients: training stays in autograd's F.linear
    assert y.requires_grad and y.grad_fn is not None
    with torch.inference_mode():  # what generation runs under
        assert not layer(torch.randn(1, 5, 64)).requires_grad
        layer(torch.randn(3, ONEDNN_MAX_ROWS // 3 + 1, 64))  # a long prompt: MKL (faster there)
    assert calls == [((1, 1, 64), torch.float32), ((1, 1, 64), torch.float32), ((1, 5, 64), torch.float32)]


def test_without_onednn_products_fall_back_to_f_linear(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    calls = _onednn_calls(monkeypatch)
    layer = Linear(64, 512)
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == []


def is_column_major(w):
    return w.t().is_contiguous() and not w.is_contiguous()


def test_wide_weights_are_stored_column_major_with_unchanged_shape_and_products():
    torch.manual_seed(0)
    wide, narrow, head = Linear(64, 192), Linear(256, 64), TiedEmbedding(1000, 64)
    assert is_column_major(wide.weight) and wide.weight.shape == (192, 64)
    assert narrow.weight.is_contiguous() and narrow.weight.shape == (64, 256)
    assert is_column_major(head.weight) and head.weight.shape == (1000, 64)
    x, ids = torch.randn(3, 64), torch.tensor([[0, 999, 5]])
    with torch.no_grad():
        plain = head.weight.contiguous()
        assert torch.equal(head(ids), F.embedding(ids, plain))
        # The same sums in another order: logits of size ~20 (N(0, 1) embeddings) may differ in the last bits.
        assert torch.allclose(head.project(x), F.linear(x, plain), atol=1e-4, rtol=0)
        assert torch.allclose(wide(x), F.linear(x, wide.weight.contiguous(), wide.bias), atol=1e-5, rtol=0)


def test_casting_picks_the_layout_of_the_new_dtype_and_keeps_the_parameters():
    layer = Linear(64, 192)
    weight = layer.weight
    values = weight.detach().clone()
    layer.to(torch.bfloat16)  # bf16 products read a row-major weight ~16x faster here
    assert layer.weight is weight and weight.is_contiguous()
    layer.float()
    assert layer.weight is weight and is_column_major(weight)
    assert torch.equal(weight.detach(), values.bfloat16().float())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loading_gives_each_dtype_its_layout(tmp_path, dtype):
    model = make_model(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=300, n_positions=16))
    checkpoints.save(model, tmp_path)
    loaded = checkpoints.load(tmp_path, dtype=dtype)  # built on the meta device, then filled in place
    wide = [loaded.wte.weight, loaded.h[0].attn.c_attn.weight, loaded.h[0].mlp.c_fc.weight]
    if dtype == "float32":
        assert all(is_column_major(w) for w in wide)
    else:
        assert all(w.is_contiguous() for w in wide)
    assert loaded.h[0].mlp.c_proj.weight.is_contiguous()  # more inputs than outputs: row-major
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
