"""Batch invariance: a request's tokens, logprobs and logits do not depend on who shares its engine.

The promise (docs/engine.md): within an engine of a given width, a request gives the same bits whoever runs
beside it, whenever they join or leave and however long they are, in every dtype, eager and compiled. Each
case runs requests together in one engine and each alone in another engine of the same width, and compares
every logit row the engine sampled from with ``torch.equal``. A 256-position window makes the decode steps
read one to four chunks of cache positions as long rows come and go, so the same request reads different
spans alone and together. (Compiled engines: test_prefix_consistency's whole-window test, alone and beside
others.)
"""

import pytest
import torch

from generate.engine.engine import Engine
from generate.engine.request import Request
from generate.engine.sampling import SamplingParams
from helpers import in_dtype, make_model, run_and_record
from model import GPTConfig

LONG_WINDOW = GPTConfig(vocab_size=97, n_positions=256, n_embd=64, n_layer=2, n_head=2)
SAMPLED = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.2)
DTYPES = ["float32", "bfloat16", "float16", "int8", "int8-body", "int4", "int4-body"]


def model_in(dtype: str):
    return in_dtype(make_model(LONG_WINDOW, seed=9, std=0.1), dtype)


def requests(seed: int = 5) -> list[Request]:
    # One row runs past 192 positions while short ones (under 64, or crossing it) come and go beside it;
    # greedy and seeded-sampling rows mixed.
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (length, budget) in enumerate([(150, 60), (5, 30), (60, 10), (2, 12), (100, 40)]):
        prompt = torch.randint(0, LONG_WINDOW.vocab_size, (length,), generator=g).tolist()
        sampling = SamplingParams(temperature=0) if i % 2 else SAMPLED
        out.append(Request(prompt, sampling, max_new_tokens=budget, seed=200 + i, eos_id=None, logprobs=True))
    return out


def fresh(r: Request) -> Request:
    return Request(r.prompt, r.sampling, r.max_new_tokens, seed=r.seed, eos_id=None, logprobs=True)


def spans_read(engine: Engine) -> list[int]:
    """Spy on the engine's decode steps: the span each asks for (appended to the list returned)."""
    spans: list[int] = []
    decode = engine.runner.decode

    def spy(tokens, positions):
        spans.append(int(positions.max()) + 1)
        return decode(tokens, positions)

    engine.runner.decode = spy
    return spans


def assert_alone_equals_together(model) -> None:
    together = requests()
    shared = Engine(model, slots=2)
    spans_together = spans_read(shared)
    seen_together = run_and_record(shared, together)
    alone_engine = Engine(model, slots=2)
    for r in together:
        single = fresh(r)
        spans_alone = spans_read(alone_engine)
        alone = run_and_record(alone_engine, [single])[id(single)]
        assert single.token_ids == r.token_ids and single.logprobs_list == r.logprobs_list, r.prompt
        assert all(torch.equal(a, b) for a, b in zip(alone, seen_together[id(r)], strict=True)), r.prompt
        if len(r.prompt) < 10:  # alone, a short request reads one chunk; beside the long rows, up to four
            assert max(spans_alone) <= 64
    assert max(spans_together) > 192


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_alone_equals_it_beside_others_in_an_engine_of_the_same_width_bitwise(dtype):
    assert_alone_equals_together(model_in(dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_same_holds_with_two_threads(dtype):
    # (The suite runs on one thread; users run on all cores, where kernels split their work.)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_alone_equals_together(model_in(dtype))
    finally:
        torch.set_num_threads(threads)


def test_a_freed_slot_leaks_nothing_into_the_next_request():
    # Fill every freed slot with NaN: the next request in that slot must give exactly what it gives in a new
    # engine (positions, penalties and cache reset).
    model = model_in("float32")
    engine = Engine(model, slots=2)
    run_and_record(engine, requests(1)[:4])
    for buffer in (*engine.cache.k, *engine.cache.v):
        buffer.fill_(float("nan"))
    later = requests(2)
    seen = run_and_record(engine, later)
    reference = run_and_record(Engine(model, slots=2), [fresh(r) for r in later])
    for r, (got, want) in zip(later, zip(seen.values(), reference.values(), strict=True), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), r.prompt


def test_finite_garbage_past_a_rows_positions_never_reaches_it():
    model = model_in("bfloat16")
    engine = Engine(model, slots=2)
    clear = engine.cache.clear

    def clear_to_garbage(slot):  # what a slot holds past its row's length: finite garbage, masked
        clear(slot)
        for buffer in (*engine.cache.k, *engine.cache.v):
            buffer[slot].fill_(1e4)

    engine.cache.clear = clear_to_garbage
    rs = requests(3)
    seen = run_and_record(engine, rs)
    reference = run_and_record(Engine(model, slots=2), [fresh(r) for r in rs])
    for got, want in zip(seen.values(), reference.values(), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
