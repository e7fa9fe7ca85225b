"""The checks and measurements that choose eager kernel routes (generate/probes.py): each measures only the
models and machines its route is for, follows the clock it is given, and refuses a route under which a row's
bits would depend on its place among the rows."""

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_CONFIGS, make_model
from generate.probes import (
    _same_in_every_position,
    body_blocks_fit,
    head_blocks_pays,
    onednn_pays,
    upcast_blocks_fit,
    upcast_min_rows,
    upcast_pieces_fastest,
    upcast_products,
)
from model.quant import quantize_int8


def test_the_position_check_finds_a_product_that_depends_on_a_rows_place():
    x, w = torch.randn(3, 1, 48), torch.randn(8, 48)
    shifted = lambda rows, w: F.linear(rows, w) + torch.arange(len(rows))[:, None, None] * 1e-3  # noqa: E731
    assert not _same_in_every_position(shifted, x, w)
    assert _same_in_every_position(shifted, x[:1], w)  # one row has one place


def test_head_blocks_are_measured_only_for_fp32_cpu_heads_and_chosen_by_the_clock(monkeypatch):
    import generate.probes as probes

    model = make_model(TINY_CONFIGS["5x3x48"], seed=1)
    assert head_blocks_pays(model.to(torch.bfloat16), 1, False) is None
    assert head_blocks_pays(quantize_int8(make_model(TINY_CONFIGS["5x3x48"], seed=1)), 1, False) is None
    model = make_model(TINY_CONFIGS["5x3x48"], seed=1)
    assert head_blocks_pays(model, 1, False) in (None, 2, 4, 8)  # whichever is faster on this machine
    timings = {2: 0.9, 4: 0.8, 8: 0.85, "other": 1.0}

    def clock(fn, x, weight, *blocks):
        return timings[blocks[0] if blocks else "other"]

    monkeypatch.setattr(probes, "_best_of", clock)
    assert head_blocks_pays(model, 3, False) == 4  # the fastest, 20% faster
    monkeypatch.setattr(probes, "_same_in_every_position", lambda *a: False)
    assert head_blocks_pays(model, 3, False) is None  # faster, but a row's bits would depend on its place
    monkeypatch.undo()
    monkeypatch.setattr(probes, "_best_of", clock)
    timings.update({2: 0.96, 4: 0.97, 8: 0.99})
    assert head_blocks_pays(model, 3, True) is None  # under 5% faster: the other route stays


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


def test_upcast_blocks_fit_only_bf16_products_where_bf16_is_emulated(monkeypatch):
    import generate.probes as probes

    model, pieces = make_model(TINY_CONFIGS["5x3x48"], seed=1).to(torch.bfloat16), 4 * 48 * 10
    monkeypatch.setattr(probes, "bf16_native", lambda: True)
    assert not upcast_blocks_fit(model, 3, 2, pieces)  # native bf16: its own products
    monkeypatch.setattr(probes, "bf16_native", lambda: False)
    assert upcast_blocks_fit(model, 3, 2, pieces) and upcast_blocks_fit(model, 1, 2, pieces)
    assert upcast_blocks_fit(model, 3, 2, 2**20)  # every product in one piece
    assert not upcast_blocks_fit(model, 3, 1, pieces)  # one block is the product itself
    assert not upcast_blocks_fit(make_model(TINY_CONFIGS["5x3x48"], seed=1), 3, 2, pieces)  # fp32
    assert not upcast_blocks_fit(quantize_int8(make_model(TINY_CONFIGS["5x3x48"], seed=1)), 3, 2, pieces)
    checked = []
    monkeypatch.setattr(  # a row's bits moved
        probes,
        "_same_in_every_position",
        lambda product, x, w, b, blocks, p: checked.append(p.nbytes) and False,
    )
    assert not upcast_blocks_fit(model, 3, 2, pieces) and checked == [pieces]  # checked in the route's pieces


def test_the_upcast_route_takes_the_bf16_products_of_models_that_compute_in_bf16_where_it_is_emulated(
    monkeypatch,
):
    import generate.probes as probes

    config = TINY_CONFIGS["5x3x48"]
    bf16, fp32 = make_model(config, seed=1).to(torch.bfloat16), make_model(config, seed=1)
    body = quantize_int8(make_model(config, seed=1), include_head=False)  # int8 layers, a bf16 head
    monkeypatch.setattr(probes, "bf16_native", lambda: True)
    assert upcast_products(bf16) == upcast_products(body) == []  # native bf16: its own products
    monkeypatch.setattr(probes, "bf16_native", lambda: False)
    ids = lambda products: [(id(w), id(b)) for w, b in products]  # noqa: E731
    every = [(m.weight, m.bias) for m in bf16.modules() if type(m) is torch.nn.Linear]
    head = [(bf16.wte.weight, None)]
    assert ids(upcast_products(bf16)) == ids(head + every) and len(every) == 4 * 5
    assert ids(upcast_products(bf16, bf16.h[0])) == ids(every[:4])
    assert ids(upcast_products(bf16, bf16.wte)) == ids(head)
    assert ids(upcast_products(body)) == ids([(body.wte.weight, None)])  # int8-body: the head alone
    assert upcast_products(fp32) == [] and upcast_products(quantize_int8(fp32)) == []
    assert upcast_blocks_fit(body, 3, 2, 4 * 48 * 10) and upcast_pieces_fastest(body, 3, 2) is not None


def test_upcast_pieces_are_measured_only_where_the_route_is_for_the_model_and_chosen_by_the_clock(
    monkeypatch,
):
    import generate.probes as probes

    model = make_model(TINY_CONFIGS["5x3x48"], seed=1).to(torch.bfloat16)
    monkeypatch.setattr(probes, "bf16_native", lambda: True)
    assert upcast_pieces_fastest(model, 3, 2) is None  # native bf16
    monkeypatch.setattr(probes, "bf16_native", lambda: False)
    assert upcast_pieces_fastest(model, 3, 1) is None  # one block
    assert upcast_pieces_fastest(make_model(TINY_CONFIGS["5x3x48"], seed=1), 3, 2) is None  # fp32
    assert upcast_pieces_fastest(model, 3, 2) in probes.DECODE_PIECE_SIZES  # whichever was fastest here
    # A scripted clock: each product costs what its piece size says; the cheapest size is chosen, and each
    # size is timed on every bf16 product of a step (5 blocks of 4 products, and the head), 3 trials and a
    # first pass not counted.
    cost, now, products = {1000: 3.0, 2000: 1.0, 3000: 2.0}, [0.0], []

    def product(x, w, b, blocks, pieces):
        products.append((tuple(w.shape), pieces.nbytes, blocks))
        now[0] += cost[pieces.nbytes]

    monkeypatch.setattr(probes, "_upcast_linear", product)
    monkeypatch.setattr(probes.time, "perf_counter", lambda: now[0])
    assert upcast_pieces_fastest(model, 3, 2, sizes=(1000, 2000, 3000)) == 2000
    assert len(products) == 4 * 3 * (5 * 4 + 1) and {blocks for *_, blocks in products} == {2}
    assert {shape for shape, *_ in products} == {(144, 48), (48, 48), (192, 48), (48, 192), (97, 48)}
    cost.update({1000: 0.5})
    assert upcast_pieces_fastest(model, 3, 2, sizes=(1000, 2000, 3000)) == 1000
    cost.update({1000: 1.06, 2000: 1.04, 3000: 1.0})  # within 5% of the fastest: the smallest of those
    assert upcast_pieces_fastest(model, 3, 2, sizes=(1000, 2000, 3000)) == 2000


def test_upcast_is_measured_only_where_bf16_is_emulated(monkeypatch):
    import generate.probes as probes

    model = make_model(TINY_CONFIGS["5x3x48"], seed=1).to(torch.bfloat16)
    monkeypatch.setattr(probes, "bf16_native", lambda: True)
    assert upcast_min_rows(model) is None
    monkeypatch.setattr(probes, "bf16_native", lambda: False)
    rows = upcast_min_rows(model, candidates=(1, 8))
    assert rows in (None, 1, 8)  # whichever the measurement says here
    assert upcast_min_rows(make_model(TINY_CONFIGS["5x3x48"], seed=1), candidates=(1, 8)) is None  # fp32


@pytest.mark.parametrize(
    ("answers", "kept"), [((None, 8, 16), 16), ((8, None, 8), 8), ((None, 4, None), None), ((2, 2, 32), 2)]
)
def test_the_upcast_row_count_is_the_median_of_three_measurements(monkeypatch, answers, kept):
    # One measurement near a break-even can say None (never upcast), which would be kept for good.
    import generate.probes as probes

    monkeypatch.setattr(probes, "bf16_native", lambda: False)
    script = iter(answers)
    monkeypatch.setattr(probes, "_upcast_rows_once", lambda layers, candidates: next(script))
    model = make_model(TINY_CONFIGS["5x3x48"], seed=1).to(torch.bfloat16)
    assert upcast_min_rows(model) == kept
    assert next(script, "all used") == "all used"
