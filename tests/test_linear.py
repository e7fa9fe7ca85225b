"""Linear: products split across threads equal the plain product."""

import pytest
import torch
import torch.nn.functional as F

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
        layer(torch.randn(1, 9, 64))  # 9 rows: a matrix product, not split
        layer.to(torch.bfloat16)(x.bfloat16())  # bf16 products already use every thread
    layer.float()(x)  # with gradients: training is never split
    with torch.inference_mode():  # what generation runs under: the pool threads must accept it too
        y = layer(torch.randn(1, 1, 64))
    assert not y.requires_grad
    assert calls == [((1, 1, 64), 2), ((1, 1, 64), 2), ((1, 1, 64), 2)]
