"""Batch invariance: a request's logits, tokens and logprobs do not depend on what else runs in the engine.

Within one engine (a fixed number of slots) every row's logits are bitwise equal alone and beside any other
requests, in any slot, in every dtype, eager and compiled: each step has the same shapes whatever runs, and
the kernels compute a row without reading the others. Across engines of different widths, bf16, fp16 and the
int8 and int4 modes stay bitwise equal (their kernels give a row the same sums at any row count); fp32
products do not (MKL sums in another order for another row count), so fp32 across widths is held to 1e-5
and equal tokens.
"""

from contextlib import nullcontext

import pytest
import torch
from test_prefix_consistency import run_and_record

from conftest import FP32_ROUTES, INT4_CONFIG, TINY_CONFIGS, make_model
from generate.engine import Engine
from generate.kernels import UpcastBF16
from generate.probes import spans_agree, step_spans_agree
from generate.request import Request
from generate.runner import Runner, decode_spans
from generate.sampling import SamplingParams
from model import GPTConfig, KVCache, attention
from model.attention import CausalAttention
from model.int4 import quantize_int4
from model.quant import quantize_int8

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
    """An engine; ``routes`` force eager kernel routes on its runner (``onednn=``, ``upcast_rows=``...), else
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


@pytest.mark.parametrize("routes", FP32_ROUTES)
def test_fp32_rows_are_bitwise_independent_on_every_eager_route(routes):
    for r, single, together, alone in alone_and_together(model_in("float32"), 3, 3, **routes):
        assert single.token_ids == r.token_ids and single.logprobs_list == r.logprobs_list
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)), r.prompt


@pytest.mark.parametrize("dtype", ["bfloat16", "int8-body", "int4-body"])
def test_bf16_rows_are_bitwise_independent_on_the_upcast_route(dtype, monkeypatch):
    # Products in fp32 on upcast weights (generate/kernels.py): prefills of 2 rows or more in the upcast
    # mode, and 3-row steps with their bf16 products (int8-body, int4-body: the head's) in 2 row blocks, in
    # pieces of 3,840 bytes (10 rows of 48, 2 of 192, 14 of int4's 64; the head's 97 rows end in a piece of 7
    # or 13, in blocked_product's overlapping blocks).
    import generate.kernels as kernels

    routed, upcast = [], kernels._upcast_blocks
    monkeypatch.setattr(
        kernels, "_upcast_blocks", lambda x, w, *a: routed.append(tuple(w.shape)) or upcast(x, w, *a)
    )
    routes = {"upcast_rows": 2, "upcast_blocks": 2, "upcast_pieces": 4 * 48 * 10}
    model = model_in(dtype)
    for r, single, together, alone in alone_and_together(model, 3, 3, **routes):
        assert single.token_ids == r.token_ids and single.logprobs_list == r.logprobs_list
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)), r.prompt
    assert tuple(model.wte.weight.shape) in routed  # the steps' heads on the route
    assert (dtype == "bfloat16") is any(shape != tuple(model.wte.weight.shape) for shape in routed)


@pytest.mark.parametrize("packs", [True, False], ids=["packed", "alone"])
def test_the_upcast_mode_is_entered_only_where_a_product_reaches_its_rows(monkeypatch, packs):
    # A TorchFunctionMode costs microseconds on every torch call, so a prompt whose products all have fewer
    # rows than the upcast route's threshold runs outside it, with the same kernels and the same bits; a
    # decode step never enters it (its upcast route is a copy of the model's modules).
    monkeypatch.setattr(Runner, "packs", property(lambda self: packs))  # prompts in packed passes, or alone
    model, decoding, entered = model_in("bfloat16"), [False], []
    enter, decode = UpcastBF16.__enter__, Runner.decode

    def spy_enter(self):
        entered.append(decoding[0])
        return enter(self)

    def spy_decode(self, *args):
        decoding[0] = True
        try:
            return decode(self, *args)
        finally:
            decoding[0] = False

    monkeypatch.setattr(UpcastBF16, "__enter__", spy_enter)
    monkeypatch.setattr(Runner, "decode", spy_decode)
    outside = requests()
    seen_outside = run_and_record(engine(model, 3, upcast_rows=4), outside)  # 3-row steps, prompts of 1..30
    assert not any(entered)  # never for a step
    if not packs:  # only the 4 prompts of at least 4 tokens (25, 14, 9 and 30), not those of 3 and 1
        assert len(entered) == sum(len(r.prompt) >= 4 for r in outside) == 4
    else:  # every packed pass has at least 16 rows
        assert entered
    entered.clear()
    monkeypatch.setattr(  # (a packed pass's head stays out of the mode: generate/runner.py)
        Runner,
        "_eager_routes",
        lambda self, rows=None, upcast=True: UpcastBF16(4) if upcast else nullcontext(),
    )
    inside = [fresh(r) for r in outside]
    seen_inside = run_and_record(engine(model, 3, upcast_rows=4), inside)
    assert entered and not any(entered)  # every prompt inside the mode, still no step
    for r, again in zip(outside, inside, strict=True):
        assert again.token_ids == r.token_ids and again.logprobs_list == r.logprobs_list
        logits, logits_again = seen_outside[id(r)], seen_inside[id(again)]
        assert all(torch.equal(a, b) for a, b in zip(logits, logits_again, strict=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8", "int8-body", "int4", "int4-body"])
def test_a_request_alone_equals_it_in_a_wider_engine_bitwise(dtype):
    for r, single, together, alone in alone_and_together(model_in(dtype), slots=4, alone_slots=1):
        assert single.token_ids == r.token_ids and single.logprobs_list == r.logprobs_list
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)), r.prompt


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8"])
def test_16_bit_attention_upcast_a_piece_of_rows_at_a_time_changes_no_bit(dtype, monkeypatch):
    # Wide eager steps over long spans upcast keys and values in pieces of rows. With pieces of one row, the
    # 3-slot engine's steps take three: every logit the same as in one piece.
    model = model_in(dtype)
    whole = requests()
    seen_whole = run_and_record(engine(model, 3), whole)
    monkeypatch.setattr(attention, "ROW_PIECE_BYTES", 1)
    piece_rows = []
    attend = CausalAttention._attend_one

    def spy(self, q, *args):
        piece_rows.append(q.shape[0])
        return attend(self, q, *args)

    monkeypatch.setattr(CausalAttention, "_attend_one", spy)
    pieces = [fresh(r) for r in whole]
    seen_pieces = run_and_record(engine(model, 3), pieces)
    assert set(piece_rows) == {1} and len(piece_rows) > 3 * CONFIG.n_layer * len(whole)
    for r, p in zip(whole, pieces, strict=True):
        assert p.token_ids == r.token_ids and p.logprobs_list == r.logprobs_list
        assert all(torch.equal(a, b) for a, b in zip(seen_pieces[id(p)], seen_whole[id(r)], strict=True))


@pytest.mark.parametrize("routes", FP32_ROUTES)
def test_fp32_alone_in_a_one_slot_engine_equals_a_wider_engine_within_1e_5(routes):
    for r, single, together, alone in alone_and_together(model_in("float32"), 4, 1, **routes):
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


# A window of 256 positions: the eager step's span follows the rows (64, 96, 128, 192, 256) where the check
# at start finds attention gives the same bits over each of them (generate/runner.py).
LONG_WINDOW = GPTConfig(vocab_size=97, n_positions=256, n_embd=64, n_layer=2, n_head=2)


def long_window_model(dtype: str):
    model = make_model(LONG_WINDOW, seed=9, std=0.1)
    if dtype.startswith("int4"):
        return quantize_int4(model, 32, include_head=dtype == "int4")
    if dtype.startswith("int8"):
        return quantize_int8(model, include_head=dtype == "int8")
    return model.to(getattr(torch, dtype))


def requests_across_spans() -> list[Request]:
    # One row runs past 192 positions while short ones (under 64, or crossing it) come and go beside it.
    g = torch.Generator().manual_seed(5)
    out = []
    for i, (length, budget) in enumerate([(150, 60), (5, 30), (60, 10), (2, 12), (100, 40)]):
        prompt = torch.randint(0, LONG_WINDOW.vocab_size, (length,), generator=g).tolist()
        sampling = SamplingParams(temperature=0) if i % 2 else SAMPLED
        out.append(Request(prompt, sampling, max_new_tokens=budget, seed=200 + i, eos_id=None, logprobs=True))
    return out


def decode_spans_read(engine: Engine, spans: list[int] | None = None) -> list[int]:
    """Spy on the engine's decode steps: the span each reads (appended to ``spans``, returned)."""
    spans = [] if spans is None else spans
    runner = engine.runner
    if runner._decode is not None:  # compiled: the step's span argument
        step = runner._decode
        runner._decode = lambda tokens, positions, span: spans.append(span) or step(tokens, positions, span)
        return spans
    forward = engine.model.forward

    def spy(ids, *args, **kwargs):
        if kwargs.get("cache") is not None and ids.shape[1] == 1:
            spans.append(kwargs.get("span") or engine.cache.max_len)
        return forward(ids, *args, **kwargs)

    engine.model.forward = spy
    return spans


def alone_beside_longer_rows(model, compile: bool) -> None:
    # The short rows' steps read 128 to 256 positions while the long row runs, 64 on alone; their logits,
    # tokens and logprobs must not change. Bitwise, in the same engine width (fp32 across widths is not).
    together = requests_across_spans()
    shared = Engine(model, slots=2, compile=compile)
    spans = decode_spans_read(shared)
    seen_together = run_and_record(shared, together)
    spans_together = set(spans)
    assert shared.runner.spans in (decode_spans(256), (256,))  # following, or every position (the check)
    alone_engine = Engine(model, slots=2, compile=compile)
    spans.clear()
    decode_spans_read(alone_engine, spans)
    for r in together:
        single = fresh(r)
        alone = run_and_record(alone_engine, [single])[id(single)]
        assert single.token_ids == r.token_ids and single.logprobs_list == r.logprobs_list, r.prompt
        assert all(torch.equal(a, b) for a, b in zip(alone, seen_together[id(r)], strict=True)), r.prompt
    if len(shared.runner.spans) > 1:
        assert min(spans_together) == 128 and {192, 256} <= spans_together and min(spans) == 64
    vars(model).pop("forward", None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_alone_equals_it_beside_longer_rows_whatever_span_the_step_reads(dtype):
    alone_beside_longer_rows(long_window_model(dtype), compile=False)


@pytest.mark.parametrize("dtype", ["float32", "int8"])  # (int8 computes in bf16)
def test_compiled_a_row_alone_equals_it_beside_longer_rows_whatever_span_the_step_reads(dtype):
    # The packaged CPU step takes its span as a dynamic size (generate/compiled.py): one compile per dtype.
    alone_beside_longer_rows(long_window_model(dtype), compile=True)


def test_the_eager_step_reads_the_span_that_holds_its_rows():
    # Alone, and two at a time: a step reads the span of its furthest row.
    model = long_window_model("float32")
    read, forward = [], model.forward

    def spy(ids, *args, **kwargs):
        if ids.shape[1] == 1:
            read.append((int(kwargs["positions"].max()), kwargs["span"]))
        return forward(ids, *args, **kwargs)

    model.forward = spy
    for slots in (1, 2):
        engine = Engine(model, slots=slots)
        engine.runner.spans = decode_spans(256)  # following, whatever the check found here
        run_and_record(engine, requests_across_spans())
    del model.forward
    assert {span for _, span in read} == {64, 96, 128, 192, 256}
    for position, span in read:
        assert span == next(s for s in decode_spans(256) if s > position), (position, span)


def test_the_span_check_finds_attention_that_depends_on_its_span(monkeypatch):
    model = long_window_model("float32")
    cached = CausalAttention._cached

    def span_dependent(self, q, k, v, positions, kv, span, shared=None):
        return cached(self, q, k, v, positions, kv, span, shared) + (span == 192) * 1e-7

    monkeypatch.setattr(CausalAttention, "_cached", span_dependent)
    assert not spans_agree(model, 2, decode_spans(256))
    assert not spans_agree(model, 1, (128, 192))
    assert spans_agree(model, 2, (64, 96, 128))  # (the spans it cannot tell apart from the others)


def test_where_spans_disagree_the_eager_step_reads_every_position(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(tmp_path))  # nothing kept from an earlier check
    monkeypatch.setattr("generate.runner.spans_agree", lambda model, rows, spans: False)
    model = long_window_model("float32")
    engine = Engine(model, slots=2)
    assert engine.runner.spans == (256,)
    spans = decode_spans_read(engine)
    run_and_record(engine, requests_across_spans())
    del model.forward
    assert set(spans) == {256}


def test_the_compiled_span_check_finds_a_step_that_depends_on_its_span():
    cache = KVCache(LONG_WINDOW, 2, 256)
    logits = torch.randn(2, LONG_WINDOW.vocab_size)

    def same(tokens, positions, span):
        return logits

    def differs_at_192(tokens, positions, span):
        return logits + (span == 192) * 1e-7

    assert step_spans_agree(same, cache, decode_spans(256), LONG_WINDOW.vocab_size)
    assert not step_spans_agree(differs_at_192, cache, decode_spans(256), LONG_WINDOW.vocab_size)


def test_where_the_compiled_spans_disagree_the_step_reads_every_position(monkeypatch, tmp_path):
    # The fp32 step of the compiled test above (the same package, loaded from the tests' cache); a fresh
    # routes file, so the check is made again, and refused.
    import shutil

    from generate.compiled import cache_dir

    shutil.copytree(cache_dir() / "steps", tmp_path / "steps")
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("generate.runner.step_spans_agree", lambda *args: False)
    engine = Engine(long_window_model("float32"), slots=2, compile=True)
    assert engine.runner.spans == (256,)
    spans = decode_spans_read(engine)
    run_and_record(engine, requests_across_spans())
    assert set(spans) == {256}
