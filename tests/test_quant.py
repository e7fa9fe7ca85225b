"""Int8 weight-only quantization: error bounds, cached decoding of the quantized model, closeness to fp32."""

import pytest
import torch

from generate import SamplingParams, generate_ids
from helpers import TINY_CONFIGS, cached_logits, make_model
from model import int4
from model.quant import Int8Linear, Int8TiedEmbedding, quantize_int8, quantize_rows


def test_quantize_rows_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(64, 128) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different scales
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.dtype == torch.bfloat16
    error = (q.float() * scale.float()[:, None] - w).abs()
    # rounding to the int8 grid costs half a step; the bf16 scale adds up to 2**-9 of the row's range
    assert (error <= scale.float()[:, None] * (0.5 + 127 * 2**-8)).all()


def test_quantized_model_structure(tiny_config):
    model = quantize_int8(make_model(tiny_config))
    assert isinstance(model.h[0].attn.c_attn, Int8Linear) and isinstance(model.wte, Int8TiedEmbedding)
    assert model.compute_dtype == torch.bfloat16
    kept = quantize_int8(make_model(tiny_config), include_head=False)
    assert not isinstance(kept.wte, Int8TiedEmbedding) and kept.wte.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("quantize", [quantize_int8, lambda m: int4.quantize_int4(m, 32)])
@pytest.mark.parametrize("convert", [lambda m: m.float(), lambda m: m.to(torch.float16), lambda m: m.half()])
def test_a_quantized_model_refuses_another_dtype_and_stays_as_it_was(quantize, convert):
    model = quantize(make_model(TINY_CONFIGS["2x2x32"]))
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        before = model(ids)
    with pytest.raises(ValueError, match=r"^a quantized model computes in bf16, it cannot be "
                       r"converted to torch\.float(16|32); load its checkpoint in that"):  # fmt: skip
        convert(model)  # (it failed at the next forward: "expected scalar type BFloat16 but found Float")
    with torch.inference_mode():
        assert torch.equal(model.to("cpu")(ids), before)  # (a move keeping the dtype is no conversion)


def test_int8_cached_decoding_tracks_its_own_full_forward():
    # Same bf16 activations as the bf16 test in test_prefix_consistency: tolerance 0.08 (5 bf16 ulps at the
    # logits' magnitude of ~3) for the same reason, matmuls of different shapes rounding differently.
    config = TINY_CONFIGS["5x3x48"]
    model = quantize_int8(make_model(config, seed=5, std=0.1))
    ids = torch.randint(
        0, config.vocab_size, (2, config.n_positions), generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        full = model(ids).float()
        cached = cached_logits(model, ids, [4] + [1] * (config.n_positions - 4)).float()
    assert (cached - full).abs().max().item() <= 0.08


def test_int8_logits_stay_close_to_fp32():
    config = TINY_CONFIGS["2x2x32"]
    fp32 = make_model(config, seed=3, std=0.3)
    int8 = quantize_int8(make_model(config, seed=3, std=0.3))
    ids = torch.randint(0, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = fp32(ids), int8(ids).float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert ((a - b).abs().mean() / a.abs().mean()).item() < 0.05  # a few percent of the logits' size
    greedy = SamplingParams(temperature=0)
    rows = generate_ids(int8, ids[:, :5].tolist(), max_new_tokens=6, sampling=greedy, eos_id=None)
    assert all(len(r.token_ids) == 6 for r in rows)


def test_rows_quantized_in_passes_equal_one_pass(monkeypatch):
    torch.manual_seed(1)
    w = torch.randn(103, 40)
    whole = quantize_rows(w)
    monkeypatch.setattr("model.quant.ROWS_PER_PASS", 10)  # 11 passes, the last one short
    parts = quantize_rows(w)
    assert torch.equal(whole[0], parts[0]) and torch.equal(whole[1], parts[1])


@pytest.mark.parametrize(("mode", "include_head"), [("int8", True), ("int8-body", False)])
def test_int8_load_quantizing_each_layer_as_read_equals_quantizing_after(
    tmp_path, tiny_config, mode, include_head
):
    import checkpoints

    checkpoints.save(make_model(tiny_config, seed=7), tmp_path)
    streamed = checkpoints.load(tmp_path, dtype=mode)
    after = quantize_int8(checkpoints.load(tmp_path), include_head=include_head)
    assert [type(m) for m in streamed.modules()] == [type(m) for m in after.modules()]
    expected = after.state_dict()
    assert streamed.state_dict().keys() == expected.keys()
    for name, tensor in streamed.state_dict().items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("rows", [1, 15, 16, 40])  # the int8 kernel below DEQUANT_ROWS, bf16 from it on
def test_int8_products_of_few_and_many_rows_equal_the_dequantized_product(rows, monkeypatch):
    import model.quant as quant

    monkeypatch.setattr(quant, "ROWS_PER_PASS", 48)  # several blocks of output rows, the last one short
    torch.manual_seed(rows)
    layer = Int8Linear(torch.nn.Linear(64, 200))
    x = torch.randn(rows, 64).to(torch.bfloat16)
    reference = x.float() @ (layer.q.float() * layer.scale.float()[:, None]).T + layer.bias.float()
    got = layer(x).float()
    # bf16 output: within a few ulps of the largest value (2**-8 relative each)
    assert (got - reference).abs().max().item() <= 4 * 2**-8 * reference.abs().max().item()
    path = "_weight_int8pack_mm"
    called = []
    monkeypatch.setattr(torch.ops.aten, path, lambda *a: called.append(1) or torch.zeros(rows, 200))
    layer(x)
    assert bool(called) == (rows < quant.DEQUANT_ROWS)
