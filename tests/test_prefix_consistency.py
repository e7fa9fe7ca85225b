"""The prefix-consistency suite: cached decoding equals the full-sequence forward at every prefix.

The full-sequence causal forward (no cache) is the reference. The model is checked through a KV cache of
per-row positions in any chunk schedule, and the engine (eager and compiled) with requests joining and leaving
slots mid-run: every logit row the engine samples from is compared with the full forward of that request's
prompt and output so far.

Tolerances: fp32 logits agree to 1e-5 of the largest logit's magnitude (max abs; absolute below 1): only
the order of floating-point sums differs (matmuls of other shapes; prompts prefilled in chunks), and with
std=0.3 weights the logits reach 8, where an error of 1e-5 is 10 ulps: measured up to 8.7e-6 on AMD Zen 4
and past 1e-5 on an Intel Xeon. bf16: with std=0.1 weights the logits stay below 4 in magnitude, where one
bf16 ulp is 2**-6 (0.016); computations of other shapes round differently, measured up to 2 ulps (0.03).
0.08 (5 ulps) allows that and stays far below what a wrong mask, position or slot causes (errors the size of
the logits).
"""

import pytest
import torch

from generate.engine.engine import Engine
from generate.engine.request import Request
from helpers import (
    BF16_TOL,
    FP32_TOL,
    GREEDY,
    TINY_CONFIGS,
    assert_engine_matches_full_forward,
    cached_logits,
    make_model,
    mixed_requests,
    run_and_record,
)
from model import GPTConfig


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_then_one_token_at_a_time_equals_full_forward(tiny_config, seed):
    model = make_model(tiny_config, seed=seed)
    n = tiny_config.n_positions
    ids = torch.randint(0, tiny_config.vocab_size, (2, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = model(ids)
        for prefill in (1, 5, n - 1):  # each prefix length t is checked at its own decode step
            cached = cached_logits(model, ids, [prefill] + [1] * (n - prefill))
            assert (cached - full).abs().max().item() <= FP32_TOL, prefill


def test_every_prefix_alone_equals_full_forward_row(tiny_config):
    model = make_model(tiny_config, seed=3)
    n = tiny_config.n_positions
    ids = torch.randint(0, tiny_config.vocab_size, (1, n), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        for t in range(1, n + 1):
            last = model(ids[:, :t], last_only=True)[:, -1]
            assert (last - full[:, t - 1]).abs().max().item() <= FP32_TOL, t


@pytest.mark.parametrize("chunks", [[3, 1, 7, 2, 11, 1], [1, 16, 2, 5], [13, 13, 3]])
def test_uneven_chunked_prefill_equals_full_forward(chunks):
    config = TINY_CONFIGS["5x3x48"]
    model = make_model(config, seed=4)
    ids = torch.randint(0, config.vocab_size, (3, sum(chunks)), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (cached_logits(model, ids, chunks, max_len=40) - model(ids)).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_at_different_positions_in_one_step_equal_each_row_alone(tiny_config, seed):
    # Each row prefilled into its own slot with its own length, then all rows stepped together, each at its
    # own position: no padding, no shared offset.
    model = make_model(tiny_config, seed=seed)
    g = torch.Generator().manual_seed(seed)
    n = tiny_config.n_positions
    lengths = [1, n - 9, 7]
    rows = [torch.randint(0, tiny_config.vocab_size, (k + 8,), generator=g) for k in lengths]
    from model import KVCache

    cache = KVCache(tiny_config, len(rows), n)
    got = [[] for _ in rows]
    with torch.no_grad():
        for s, (k, row) in enumerate(zip(lengths, rows, strict=True)):
            got[s].append(model(row[None, :k], positions=torch.arange(k)[None], cache=cache, slot=s)[0])
        for step in range(8):
            pos = torch.tensor([[k + step] for k in lengths])
            tokens = torch.stack([row[k + step] for k, row in zip(lengths, rows, strict=True)])[:, None]
            logits = model(tokens, positions=pos, cache=cache)
            for s in range(len(rows)):
                got[s].append(logits[s])
        for s, row in enumerate(rows):
            assert (torch.cat(got[s]) - model(row[None])[0]).abs().max().item() <= FP32_TOL, s


@pytest.mark.parametrize("seed", [0, 1])
def test_engine_with_rows_joining_mid_run_equals_full_forward_at_every_prefix(tiny_config, seed):
    model = make_model(tiny_config, seed=seed, std=0.3)
    requests = mixed_requests(tiny_config, seed)
    seen = run_and_record(Engine(model, slots=2), requests)
    assert_engine_matches_full_forward(model, requests, seen, FP32_TOL)


def test_bf16_engine_tracks_full_forward_at_every_prefix(tiny_config):
    model = make_model(tiny_config, seed=5, std=0.1).to(torch.bfloat16)
    requests = mixed_requests(tiny_config, 5)
    seen = run_and_record(Engine(model, slots=3), requests)
    assert_engine_matches_full_forward(model, requests, seen, BF16_TOL)


# A 256-position window (four chunks of cache positions), filled to its end: generations that fill the window
# while shorter rows join and leave, so the decode steps read one to four chunks.
LONG_WINDOW = GPTConfig(vocab_size=97, n_positions=256, n_embd=48, n_layer=2, n_head=3)


def whole_window_requests(seed: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for length, budget in [(3, 300), (60, 20), (1, 90), (200, 100), (130, 2), (10, 40)]:
        prompt = torch.randint(0, LONG_WINDOW.vocab_size, (length,), generator=g).tolist()
        out.append(Request(prompt, GREEDY, max_new_tokens=budget, eos_id=None))
    return out


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generations_that_fill_the_window_equal_the_full_forward_at_every_prefix(dtype, compile):
    # Requests joining and leaving a 3-slot engine, two of them filling the window to its end; then each of
    # three again alone in another engine of the same width (compiled: the same step, loaded), bit for bit.
    model = make_model(LONG_WINDOW, seed=7, std=0.1).to(dtype)
    requests = whole_window_requests(7)
    seen = run_and_record(Engine(model, slots=3, compile=compile), requests)
    assert requests[0].finish_reason == "length" and len(requests[0].prompt + requests[0].token_ids) == 256
    assert requests[3].finish_reason == "length" and len(requests[3].token_ids) == 56  # the window's end
    assert_engine_matches_full_forward(
        model, requests, seen, FP32_TOL if dtype == torch.float32 else BF16_TOL
    )
    alone_engine = Engine(model, slots=3, compile=compile)
    for r in requests[1:4]:
        single = Request(r.prompt, GREEDY, max_new_tokens=r.max_new_tokens, eos_id=None)
        alone = run_and_record(alone_engine, [single])[id(single)]
        assert single.token_ids == r.token_ids
        assert all(torch.equal(a, b) for a, b in zip(alone, seen[id(r)], strict=True)), r.prompt
