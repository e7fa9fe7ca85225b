"""Int4 weight-only quantization: error bounds, the kernels against the dequantized reference (padded rows
included), the tied lookup, streamed loading, cached decoding of the quantized model, closeness to fp32."""

import pytest
import torch

from generate import SamplingParams, generate_ids
from helpers import INT4_CONFIG, TINY_CONFIGS, cached_logits, dequantize, make_model
from model import GPTConfig, int4
from model.int4 import Int4Linear, Int4TiedEmbedding, quantize_groups, quantize_int4


@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
def test_quantize_groups_error_is_half_a_step_plus_the_bf16_rounding_of_scale_and_zero(group_size):
    torch.manual_seed(0)
    w = torch.randn(96, 256) * torch.logspace(-2, 1, 96)[:, None] + torch.randn(96, 1)  # offsets and scales
    codes, scales_zeros = quantize_groups(w, group_size)
    assert codes.shape == (96, 128) and codes.dtype == torch.uint8
    assert scales_zeros.shape == (256 // group_size, 96, 2) and scales_zeros.dtype == torch.bfloat16
    error = (dequantize(codes, scales_zeros) - w).abs().view(96, -1, group_size)
    groups = w.view(96, -1, group_size)
    scale = scales_zeros[..., 0].float().T  # (N, G)
    # Half a step of rounding; the range can fall short of the group's ends by the bf16 rounding of the scale
    # (15 steps of 2**-8 relative) and of the zero (2**-8 of its size), which the clamp then costs.
    bound = scale * (0.5 + 15 * 2**-8) + 2**-8 * groups.abs().amax(-1)
    assert (error <= bound[..., None]).all()
    assert (error.amax(-1) <= scale * 0.5 + 1e-6).float().mean() > 0.9  # mostly plain rounding


def test_a_constant_group_and_a_zero_row_come_back_exactly():
    w = torch.zeros(3, 64)
    w[1] = 0.375
    codes, scales_zeros = quantize_groups(w, 32)
    assert torch.equal(dequantize(codes, scales_zeros), w)


def test_rows_and_packing_in_passes_equal_one_pass(monkeypatch):
    torch.manual_seed(1)
    w = torch.randn(300, 64)  # 300 rows: padded to 320, packed in 64-row passes, the last one short
    whole = quantize_groups(w, 32)
    packed = int4.pack(whole[0])
    monkeypatch.setattr("model.int4.WEIGHTS_PER_PASS", 64 * 64)  # one row block a pass
    parts = quantize_groups(w, 32)
    assert torch.equal(whole[0], parts[0]) and torch.equal(whole[1], parts[1])
    assert torch.equal(int4.pack(parts[0]), packed)


@pytest.mark.parametrize(("rows", "group_size"), [(100, 32), (192, 64), (37, 128)])
def test_the_kernel_equals_the_dequantized_product_and_padding_changes_no_output(rows, group_size):
    # Row counts that are not multiples of the 64-row block are padded; the real outputs must be the products
    # with the dequantized weight (bf16 inputs, fp32 sums, bf16 output: within 2 bf16 ulps of the result).
    torch.manual_seed(2)
    linear = torch.nn.Linear(256, rows)
    layer = Int4Linear.from_linear(linear, group_size)
    assert layer.packed.shape[0] % int4.ROW_BLOCK == 0 and layer.packed.shape[0] >= rows
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    codes, scales_zeros = quantize_groups(linear.weight, group_size)
    reference = x.float() @ dequantize(codes, scales_zeros).T + linear.bias.to(torch.bfloat16).float()
    y = layer(x)
    assert y.shape == (2, 3, rows) and y.dtype == torch.bfloat16
    assert ((y.float() - reference).abs() <= 2 * 2**-8 * reference.abs() + 1e-2).all()


@pytest.mark.parametrize("rows", [1, 255, 256, 300])  # the int4 kernel below DEQUANT_ROWS, bf16 from it on
def test_int4_products_of_few_and_many_rows_equal_the_dequantized_product(rows, monkeypatch):
    monkeypatch.setattr(int4, "WEIGHTS_PER_PASS", 64 * 256)  # 64 weight rows a pass: 4 passes, the last short
    torch.manual_seed(rows)
    linear = torch.nn.Linear(256, 200)
    layer = Int4Linear.from_linear(linear, 32)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    reference = x.float() @ dequantize(*quantize_groups(linear.weight, 32)).T + layer.bias.float()
    got = layer(x).float()
    # bf16 output (and from DEQUANT_ROWS on bf16 weights): within a few ulps of the largest value
    assert got.shape == (rows, 200) and (got - reference).abs().max() <= 4 * 2**-8 * reference.abs().max()
    called = []
    kernel = "_weight_int4pack_mm_for_cpu"
    monkeypatch.setattr(torch.ops.aten, kernel, lambda *a: called.append(1) or torch.zeros(rows, 256))
    layer(x)
    assert bool(called) == (rows < int4.DEQUANT_ROWS)


_READ_BACK = """
import torch
from model import int4
torch.manual_seed(0)
weight = torch.randn(300, 256) * torch.logspace(-2, 1, 300)[:, None] + torch.randn(300, 1)
codes, scales_zeros = int4.quantize_groups(weight, 32)
q = int4.unpack_codes(codes).float().view(300, 8, 32) - 8
s, z = scales_zeros.float().permute(2, 1, 0)
expected = (q * s[..., None] + z[..., None]).view(300, 256).to(torch.bfloat16)
got = int4._dequantized_t(int4.pack(codes), 32, int4._pad_scales(scales_zeros))[:, :300].T
assert torch.equal(got, expected), (got.float() - expected.float()).abs().max()
print(torch.backends.cpu.get_cpu_capability(), int4._cpu_layout()[0])
"""


@pytest.mark.parametrize("capability", [None, "avx2", "default"])
def test_many_row_products_read_the_packed_weights_right_under_every_cpu_packing(capability):
    # The CPU packing's layout follows torch's CPU capability (blocks of 64 rows with AVX-512, 32 with AVX2,
    # pairs of rows without); ATEN_CPU_CAPABILITY runs a process at a lower one. Each weight read back is
    # its fp32 value rounded once to bf16, bit for bit.
    import os
    import subprocess
    import sys

    env = {**os.environ, **({"ATEN_CPU_CAPABILITY": capability} if capability else {})}
    done = subprocess.run([sys.executable, "-c", _READ_BACK], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if capability:
        assert done.stdout.split()[0] == capability.upper()


def test_the_tied_lookup_and_head_use_the_same_int4_values():
    torch.manual_seed(3)
    weight = torch.randn(97, 64)  # a vocabulary that is not a multiple of 64: the head is padded
    head = Int4TiedEmbedding(*quantize_groups(weight, 32), 32)
    table = dequantize(*quantize_groups(weight, 32))
    ids = torch.tensor([[0, 96, 5], [5, 5, 40]])
    rows = head(ids)
    assert rows.shape == (2, 3, 64) and rows.dtype == torch.bfloat16
    assert torch.allclose(rows.float(), table[ids], rtol=2**-7, atol=1e-6)  # bf16 arithmetic of the lookup
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    logits = head.project(x)
    assert logits.shape == (4, 97)
    reference = x.float() @ table.T
    assert ((logits.float() - reference).abs() <= 2 * 2**-8 * reference.abs() + 1e-2).all()


def test_quantized_model_structure():
    model = quantize_int4(make_model(INT4_CONFIG), 64)
    assert isinstance(model.h[0].mlp.c_fc, Int4Linear) and isinstance(model.wte, Int4TiedEmbedding)
    assert model.h[0].mlp.c_proj.group_size == 64 and model.compute_dtype == torch.bfloat16
    kept = quantize_int4(make_model(INT4_CONFIG), include_head=False)
    assert not isinstance(kept.wte, Int4TiedEmbedding) and kept.wte.weight.dtype == torch.bfloat16


def test_int4_cached_decoding_tracks_its_own_full_forward():
    # bf16 activations as in the int8 and bf16 tests: tolerance 0.08 (5 bf16 ulps at the logits' size).
    model = quantize_int4(make_model(INT4_CONFIG, seed=5, std=0.1))
    n = INT4_CONFIG.n_positions
    ids = torch.randint(0, INT4_CONFIG.vocab_size, (2, n), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).float()
        cached = cached_logits(model, ids, [4] + [1] * (n - 4)).float()
    assert (cached - full).abs().max().item() <= 0.08


@pytest.mark.parametrize("mode", ["int4", "int4-body"])
def test_an_int4_engine_with_rows_joining_mid_run_tracks_the_full_forward_at_every_prefix(mode):
    from generate.engine.engine import Engine
    from helpers import BF16_TOL, assert_engine_matches_full_forward, mixed_requests, run_and_record

    model = quantize_int4(make_model(INT4_CONFIG, seed=4, std=0.1), 32, include_head=mode == "int4")
    requests = mixed_requests(INT4_CONFIG, 4)
    seen = run_and_record(Engine(model, slots=2), requests)
    assert_engine_matches_full_forward(model, requests, seen, BF16_TOL)


@pytest.mark.parametrize("include_head", [True, False])
def test_an_int4_model_computes_what_fp32_does_with_the_dequantized_weights(include_head):
    # The int4 model against the fp32 model whose quantized layers hold the dequantized weights: only bf16
    # activations differ (the bf16 tolerance, 0.08; a bf16 copy of the reference differs as much).
    reference = make_model(INT4_CONFIG, seed=3, std=0.1)
    quantized = quantize_int4(make_model(INT4_CONFIG, seed=3, std=0.1), 32, include_head=include_head)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) or (include_head and name == "wte"):
                module.weight.copy_(dequantize(*quantize_groups(module.weight, 32)))
    ids = torch.randint(0, INT4_CONFIG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = reference(ids), quantized(ids).float()
    assert (a - b).abs().max().item() <= 0.08
    greedy = SamplingParams(temperature=0)
    rows = generate_ids(quantized, ids[:, :5].tolist(), max_new_tokens=6, sampling=greedy, eos_id=None)
    assert all(len(r.token_ids) == 6 for r in rows)


@pytest.fixture(scope="module")
def held_out():
    """The shipped model's recorded held-out slice (257 tokens) and its fp32 loss there."""
    import json

    from checkpoints.load import SHIPPED_DIR

    facts = json.loads((SHIPPED_DIR / "shakespeare" / "training.json").read_text())
    return torch.tensor(facts["held_out_slice"]["token_ids"]), facts["held_out_slice"]["loss"]


@pytest.mark.parametrize("group_size", int4.GROUP_SIZES)
@pytest.mark.parametrize("mode", ["int4", "int4-body"])
def test_int4_on_the_shipped_model_stays_within_a_tenth_of_a_nat_of_fp32(held_out, mode, group_size):
    # The quality bound on real weights (bench/quant_quality.py measures 16,384 tokens; this is the
    # card's 257-token slice): held-out loss within 0.10 nats of fp32.
    import torch.nn.functional as F

    import checkpoints

    ids, fp32_loss = held_out
    model = checkpoints.load("shakespeare", dtype=mode, group_size=group_size)
    with torch.no_grad():
        loss = F.cross_entropy(model(ids[None, :-1])[0].float(), ids[1:]).item()
    assert abs(loss - fp32_loss) <= 0.10


@pytest.mark.parametrize(
    ("mode", "include_head", "group_size"), [("int4", True, None), ("int4-body", False, 64)]
)
def test_int4_load_quantizing_each_layer_as_read_equals_quantizing_after(
    tmp_path, mode, include_head, group_size
):
    import checkpoints

    checkpoints.save(make_model(INT4_CONFIG, seed=7), tmp_path)
    streamed = checkpoints.load(tmp_path, dtype=mode, group_size=group_size)
    after = quantize_int4(checkpoints.load(tmp_path), group_size or 32, include_head=include_head)
    assert [type(m) for m in streamed.modules()] == [type(m) for m in after.modules()]
    expected = after.state_dict()
    assert streamed.state_dict().keys() == expected.keys()
    for name, tensor in streamed.state_dict().items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


def test_int4_on_a_torch_without_its_cpu_kernels_is_refused_naming_the_version_and_the_fix(
    tmp_path, monkeypatch
):
    # Before torch 2.6 there is no CPU int4 packing: one clear error before a weight is read.
    import types

    from torch.torch_version import TorchVersion

    import checkpoints

    checkpoints.save(make_model(TINY_CONFIGS["2x2x32"]), tmp_path)
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.5.1+cpu"))
    monkeypatch.setattr(
        torch.ops, "aten", types.SimpleNamespace()
    )  # (no _convert_weight_to_int4pack_for_cpu)
    with pytest.raises(
        RuntimeError, match=r"^int4 needs torch 2\.6 or newer, not 2\.5\.1\+cpu; pip install torch"
    ):
        checkpoints.load(tmp_path, dtype="int4")


def test_bad_group_sizes_are_refused_naming_the_value_and_the_fix(tmp_path):
    import checkpoints

    checkpoints.save(make_model(TINY_CONFIGS["5x3x48"]), tmp_path)  # widths 48 and 192
    with pytest.raises(ValueError, match=r"group_size 32 .* width 48; no int4 group size \(32, 64, 128\) "
                                         r"divides it: use int8$"):  # fmt: skip
        checkpoints.load(tmp_path, dtype="int4")
    # The group sizes offered divide every width, not only the one named (widths 64, then 96).
    wide = GPTConfig(vocab_size=97, n_positions=40, n_embd=64, n_layer=1, n_head=2, n_inner=96)
    checkpoints.save(make_model(wide), tmp_path / "wide")
    with pytest.raises(ValueError, match=r"group_size 64 .* width 96; use group_size 32$"):
        checkpoints.load(tmp_path / "wide", dtype="int4", group_size=64)
    with pytest.raises(ValueError, match=r"group_size 128 .* width 64; use group_size 32$"):
        checkpoints.load(tmp_path / "wide", dtype="int4-body", group_size=128)
    checkpoints.save(make_model(INT4_CONFIG), tmp_path / "int4")  # widths 64 and 256
    with pytest.raises(ValueError, match=r"group_size 128 .* width 64; use group_size 32 or 64$"):
        checkpoints.load(tmp_path / "int4", dtype="int4", group_size=128)
    with pytest.raises(ValueError, match=r"must be one of \(32, 64, 128\), got 48"):
        checkpoints.load(tmp_path, dtype="int4", group_size=48)
    with pytest.raises(ValueError, match=r"must be one of \(32, 64, 128\), got 64\.0"):
        checkpoints.load(tmp_path, dtype="int4", group_size=64.0)
    with pytest.raises(ValueError, match=r"unsupported dtype 'int2'"):  # the dtype first, then its group size
        checkpoints.load(tmp_path, dtype="int2", group_size=32)
    with pytest.raises(
        ValueError, match=r"group_size=32 applies to dtype 'int4' or 'int4-body' only, not 'int8'"
    ):
        checkpoints.load(tmp_path, dtype="int8", group_size=32)
    with pytest.raises(ValueError, match="int4-quantized"):
        checkpoints.save(quantize_int4(make_model(INT4_CONFIG)), tmp_path / "out")
    assert not (tmp_path / "out").exists()
