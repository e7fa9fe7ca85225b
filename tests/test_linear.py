"""Linear: column-major storage and products split across threads change no result."""

import pytest
import torch
import torch.nn.functional as F

import checkpoints
from conftest import make_model
from model import GPTConfig
from model.linear import Linear, TiedEmbedding, split_linear


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("rows", [1, 4])
def test_split_product_equals_plain_product(parts, rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(1000, 96), torch.randn(1000), torch.randn(rows, 96)
    assert torch.allclose(split_linear(x, w, b, parts), F.linear(x, w, b), atol=1e-5, rtol=0)
    assert torch.allclose(split_linear(x[None], w, None, parts), F.linear(x[None], w), atol=1e-5, rtol=0)


def test_linear_splits_only_small_fp32_inference_products(monkeypatch):
    calls = []
    real = split_linear

    def spy(x, weight, bias, parts):
        calls.append((tuple(x.shape), parts))
        return real(x, weight, bias, parts)

    monkeypatch.setattr("model.linear.split_linear", spy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    layer, head = Linear(64, 512), TiedEmbedding(1024, 64)
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-6)
        assert torch.allclose(head.project(x), F.linear(x, head.weight), atol=1e-6)
        layer(torch.randn(1, 5, 64))  # 5 rows: not split (measured slower than one product)
        layer.to(torch.bfloat16)(x.bfloat16())  # bf16 products already use every thread
    layer.float()(x)  # with gradients: training is never split
    with torch.inference_mode():  # what generation runs under: the pool threads must accept it too
        y = layer(torch.randn(1, 1, 64))
    assert not y.requires_grad
    assert calls == [((1, 1, 64), 2), ((1, 1, 64), 2), ((1, 1, 64), 2)]


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
