"""Batch invariance: a request's logits, tokens and logprobs do not depend on what else runs in the engine.

Within one engine (a fixed number of slots) every row's logits are bitwise equal alone and beside any other
requests, in any slot, in every dtype, eager and compiled: each step has the same shapes whatever runs, and
the kernels compute a row without reading the others. Across engines of different widths, bf16, fp16 and the
int8 and int4 modes stay bitwise equal (their kernels give a row the same sums at any row count); fp32
products do not (MKL sums in another order for another row count), so fp32 across widths is held to 1e-5
and equal tokens.
"""

import pytest
import torch
from test_prefix_consistency import run_and_record

from conftest import INT4_CONFIG, TINY_CONFIGS, make_model
from generate.engine import Engine
from generate.kernels import onednn_available
from generate.request import Request
from generate.sampling import SamplingParams
from model.int4 import quantize_int4
from model.quant import quantize_int8

# The eager fp32 routes: F.linear, and oneDNN where this build has it (generate/kernels.py).
ROUTES = [False, pytest.param(True, marks=pytest.mark.skipif(not onednn_available(), reason="no oneDNN"))]


CONFIG = TINY_CONFIGS["5x3x48"]
SAMPLED = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.2)


def model_in(dtype: str):
    if dtype.startswith("int4"):  # the same vocabulary and window, widths its group sizes divide
        return quantize_int4(make_model(INT4_CONFIG, seed=8, std=0.1), 32, include_head=dtype == "int4")
    model = make_model(CONFIG, seed=8, std=0.1)
    if dtype == "int8":
        return quantize_int8(model)
    if dtype == "int8-body":
        return quantize_int8(model, include_head=False)
    return model.to(getattr(torch, dtype))


def requests(seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, length in enumerate([3, 25, 1, 14, 9, 30]):
        prompt = torch.randint(0, CONFIG.vocab_size, (length,), generator=g).tolist()
        sampling = SamplingParams(temperature=0) if i % 2 else SAMPLED  # greedy and seeded rows mixed
        out.append(Request(prompt, sampling, max_new_tokens=4 + i, seed=100 + i, eos_id=None, logprobs=True))
    return out


def fresh(r: Request) -> Request:
    return Request(r.prompt, r.sampling, r.max_new_tokens, seed=r.seed, eos_id=None, logprobs=True)


def engine(model, slots: int, compile: bool = False, **routes) -> Engine:
    """An engine; ``routes`` force eager kernel routes on its runner (``onednn=``, ``upcast_rows=``), else
    they are what was measured here."""
    made = Engine(model, slots=slots, compile=compile)
    for name, value in routes.items():
        setattr(made.runner, name, value)
    return made


def alone_and_together(model, slots: int, alone_slots: int, compile: bool = False, **routes):
    together = requests()
    seen_together = run_and_record(engine(model, slots, compile, **routes), together)
    alone_engine = engine(model, alone_slots, compile, **routes)
    results = []
    for r in together:
        single = fresh(r)
        seen_alone = run_and_record(alone_engine, [single])
        results.append((r, single, seen_together[id(r)], seen_alone[id(single)]))
    return results


DTYPES = ["float32", "bfloat16", "float16", "int8", "int8-body", "int4", "int4-body"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_alone_equals_it_beside_others_in_the_same_engine_bitwise(dtype):
    # Six requests through 3 slots (rows join as others leave), then each alone in a 3-slot engine.
    for r, single, together, alone in alone_and_together(model_in(dtype), slots=3, alone_slots=3):
        assert single.token_ids == r.token_ids and single.logprobs_list == r.logprobs_list
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)), r.prompt


@pytest.mark.parametrize("onednn", ROUTES, ids=["aten", "onednn"])
def test_fp32_rows_are_bitwise_independent_on_either_eager_route(onednn):
    for r, single, together, alone in alone_and_together(model_in("float32"), 3, 3, onednn=onednn):
        assert single.token_ids == r.token_ids and single.logprobs_list == r.logprobs_list
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)), r.prompt


def test_bf16_rows_are_bitwise_independent_on_the_upcast_route():
    # Products of 2 rows or more in fp32 on upcast weights (generate/kernels.py): prefills and 3-row steps.
    for r, single, together, alone in alone_and_together(model_in("bfloat16"), 3, 3, upcast_rows=2):
        assert single.token_ids == r.token_ids and single.logprobs_list == r.logprobs_list
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)), r.prompt


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8", "int8-body", "int4", "int4-body"])
def test_a_request_alone_equals_it_in_a_wider_engine_bitwise(dtype):
    for r, single, together, alone in alone_and_together(model_in(dtype), slots=4, alone_slots=1):
        assert single.token_ids == r.token_ids and single.logprobs_list == r.logprobs_list
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)), r.prompt


@pytest.mark.parametrize("onednn", ROUTES, ids=["aten", "onednn"])
def test_fp32_alone_in_a_one_slot_engine_equals_a_wider_engine_within_1e_5(onednn):
    for r, single, together, alone in alone_and_together(model_in("float32"), 4, 1, onednn=onednn):
        assert single.token_ids == r.token_ids
        assert max((a - b).abs().max().item() for a, b in zip(alone, together, strict=True)) <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "int8-body", "int4"])
def test_compiled_a_request_alone_equals_it_beside_others_bitwise(dtype):
    for r, single, together, alone in alone_and_together(model_in(dtype), 2, 2, compile=True):
        assert single.token_ids == r.token_ids and single.logprobs_list == r.logprobs_list
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)), r.prompt


def test_a_freed_slot_leaks_nothing_into_the_next_request():
    # Fill every freed slot with NaN, and every position past a running row's length with huge values: the
    # next request in that slot must give exactly what it gives in a new engine (positions, penalties and
    # cache reset; masked positions never reach a row).
    model = model_in("float32")
    engine = Engine(model, slots=2)
    first = requests(1)[:4]
    run_and_record(engine, first)
    for buffer in (*engine.cache.k, *engine.cache.v):
        buffer.fill_(float("nan"))
    later = requests(2)
    seen = run_and_record(engine, later)
    reference = run_and_record(Engine(model, slots=2), [fresh(r) for r in later])
    for r, (got, want) in zip(later, zip(seen.values(), reference.values(), strict=True), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), r.prompt


def test_masked_cache_positions_do_not_reach_a_row():
    model = model_in("bfloat16")
    engine = Engine(model, slots=2)
    clear = engine.cache.clear

    def clear_to_garbage(slot):  # what a slot holds past its row's length: finite garbage, never read
        clear(slot)
        for buffer in (*engine.cache.k, *engine.cache.v):
            buffer[slot].fill_(1e4)

    engine.cache.clear = clear_to_garbage
    rs = requests(3)
    seen = run_and_record(engine, rs)
    reference = run_and_record(Engine(model, slots=2), [fresh(r) for r in rs])
    for got, want in zip(seen.values(), reference.values(), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
