"""Property-based tests: the core guarantees hold for random configs, batches, chunk schedules and texts."""

from unittest import mock

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoints import load_tokenizer
from conftest import greedy_by_recomputation, make_model
from generate import SamplingParams, engine, generate_ids
from model import GPTConfig, KVCache

FP32_TOL = 1e-5
GREEDY = SamplingParams(temperature=0)
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def configs(draw):
    heads = draw(st.integers(1, 4))
    return GPTConfig(
        vocab_size=draw(st.integers(8, 120)),
        n_positions=draw(st.integers(4, 40)),
        n_embd=heads * draw(st.integers(1, 8)),
        n_layer=draw(st.integers(1, 3)),
        n_head=heads,
    )


@st.composite
def chunk_schedules(draw, total):
    chunks = []
    while sum(chunks) < total:
        chunks.append(draw(st.integers(1, total - sum(chunks))))
    return chunks


@SETTINGS
@given(config=configs(), data=st.data())
def test_any_chunk_schedule_equals_full_forward_and_never_reads_past_fill(config, data):
    model = make_model(config, seed=data.draw(st.integers(0, 2**16)))
    n = data.draw(st.integers(1, config.n_positions))
    ids = torch.tensor([data.draw(st.lists(st.integers(0, config.vocab_size - 1), min_size=n, max_size=n))])
    cache = KVCache(config, 1, n)
    cache.k.fill_(float("nan"))  # anything read past the fill level would turn the output into NaN
    cache.v.fill_(float("nan"))
    parts, start = [], 0
    with torch.no_grad():
        for size in data.draw(chunk_schedules(n)):
            parts.append(model(ids[:, start : start + size], cache=cache))
            start += size
        assert (torch.cat(parts, 1) - model(ids)).abs().max().item() <= FP32_TOL


@SETTINGS
@given(config=configs(), data=st.data())
def test_each_row_of_a_left_padded_batch_equals_the_row_alone(config, data):
    model = make_model(config, seed=data.draw(st.integers(0, 2**16)))
    rows = data.draw(st.integers(1, 6))
    token = st.integers(0, config.vocab_size - 1)
    prompts = [data.draw(st.lists(token, min_size=1, max_size=config.n_positions)) for _ in range(rows)]
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        assert torch.isfinite(batched).all()
        for i, p in enumerate(prompts):
            alone = model(torch.tensor([p]))[0]
            assert (batched[i, longest - len(p) :] - alone).abs().max().item() <= FP32_TOL


@SETTINGS
@given(
    config=configs(),
    data=st.data(),
    params=st.builds(
        SamplingParams,
        temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
        top_k=st.integers(0, 10),
        top_p=st.floats(0.05, 1.0),
        min_p=st.floats(0.0, 0.5),
        repetition_penalty=st.floats(0.5, 2.0),
        presence_penalty=st.floats(-1.0, 1.0),
        frequency_penalty=st.floats(-1.0, 1.0),
    ),
)
def test_generation_is_reproducible_and_independent_of_the_batch(config, data, params):
    model = make_model(config, seed=data.draw(st.integers(0, 2**16)), std=0.3)
    token = st.integers(0, config.vocab_size - 1)
    prompts = [data.draw(st.lists(token, min_size=1, max_size=config.n_positions - 1)) for _ in range(3)]
    kwargs = dict(max_new_tokens=data.draw(st.integers(0, 8)), sampling=params, seed=7, eos_id=None)
    batch = generate_ids(model, prompts, **kwargs)
    assert generate_ids(model, prompts, **kwargs) == batch  # deterministic (greedy or seeded)
    for p, row in zip(prompts, batch, strict=True):
        assert len(row.token_ids) <= kwargs["max_new_tokens"]
        assert all(0 <= t < config.vocab_size for t in row.token_ids)
        assert generate_ids(model, [p], **kwargs)[0] == row


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_decode_encode_round_trips_any_unicode(text):
    enc = load_tokenizer()
    assert enc.decode(enc.encode_ordinary(text)) == text


def nan_filled_cache(config, batch, max_len):
    """A KVCache whose buffers start as NaN: anything read past the fill level turns the output into NaN."""
    cache = KVCache(config, batch, max_len)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    return cache


@SETTINGS
@given(config=configs(), data=st.data())
def test_left_padded_batches_through_the_cache_in_any_chunks_equal_each_row_alone(config, data):
    # 1..6 rows of any lengths 1..n_positions-1, left-padded, then continued by real tokens; fed through
    # the cache in a random chunk schedule (chunks may start and end inside the padding). Every real position
    # of each row must equal that row's full uncached forward alone.
    model = make_model(config, seed=data.draw(st.integers(0, 2**16)))
    n = config.n_positions
    rows = data.draw(st.integers(1, 6), label="rows")
    token = st.integers(0, config.vocab_size - 1)
    prompts = [data.draw(st.lists(token, min_size=1, max_size=n - 1)) for _ in range(rows)]
    longest = max(len(p) for p in prompts)
    extra = data.draw(st.integers(0, n - longest), label="continued positions")
    rest = [data.draw(st.lists(token, min_size=extra, max_size=extra)) for _ in range(rows)]
    ids = torch.tensor([[0] * (longest - len(p)) + p + r for p, r in zip(prompts, rest, strict=True)])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * (len(p) + extra) for p in prompts])
    total = longest + extra
    schedule = data.draw(chunk_schedules(total), label="chunks")
    cache = nan_filled_cache(config, rows, data.draw(st.integers(total, n), label="max_len"))
    parts, start = [], 0
    with torch.no_grad():
        for size in schedule:
            parts.append(
                model(ids[:, start : start + size], cache=cache, attention_mask=mask[:, : start + size])
            )
            start += size
        batched = torch.cat(parts, 1)
        assert cache.length == total
        assert torch.isfinite(batched).all()  # padding positions included: nothing read past the fill level
        for i, (p, r) in enumerate(zip(prompts, rest, strict=True)):
            alone = model(torch.tensor([p + r]))[0]
            assert (batched[i, longest - len(p) :] - alone).abs().max().item() <= FP32_TOL, i


class NaNTailCache(KVCache):
    """A KVCache that keeps every position at or past its fill level NaN: at allocation and after each
    ``drop_front`` (whose shift leaves stale copies there). A read of any of them makes the logits NaN."""

    drops = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.k.fill_(float("nan"))
        self.v.fill_(float("nan"))

    def drop_front(self, n):
        super().drop_front(n)
        self.k[:, :, :, self.length :] = float("nan")
        self.v[:, :, :, self.length :] = float("nan")
        NaNTailCache.drops += 1


@SETTINGS
@given(config=configs(), data=st.data())
def test_decoder_never_reads_past_the_fill_level_even_when_the_window_end_shifts_the_cache(config, data):
    # A left-padded batch whose longest row reaches the window's end while a row at least 2 tokens shorter
    # keeps going: the Decoder must shift the full cache (drop_front) and still read only filled positions.
    model = make_model(config, seed=data.draw(st.integers(0, 2**16)), std=0.3)  # clear argmax margins
    n = config.n_positions
    token = st.integers(0, config.vocab_size - 1)
    longest = data.draw(st.integers(3, n - 1), label="longest")
    lengths = [longest, data.draw(st.integers(1, longest - 2), label="short")]
    lengths += data.draw(st.lists(st.integers(1, longest), max_size=3), label="others")
    prompts = [data.draw(st.lists(token, min_size=k, max_size=k)) for k in lengths]
    prompts = data.draw(st.permutations(prompts), label="order")
    outputs = []
    hook = model.register_forward_hook(lambda _m, _a, out: outputs.append(torch.isfinite(out).all().item()))
    NaNTailCache.drops = 0
    try:
        with mock.patch.object(engine, "KVCache", NaNTailCache):
            rows = generate_ids(model, prompts, max_new_tokens=n, sampling=GREEDY, eos_id=None)
    finally:
        hook.remove()
    assert NaNTailCache.drops > 0  # the window-end path really ran
    assert outputs and all(outputs)  # every row's logits finite at every step, finished rows included
    for p, row in zip(prompts, rows, strict=True):
        assert len(p) + len(row.token_ids) == n and row.finish_reason == "length"
        assert row.token_ids == greedy_by_recomputation(model, p, n)
