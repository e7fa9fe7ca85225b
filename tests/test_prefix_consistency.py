"""The prefix-consistency suite: cached decoding equals the full-sequence forward at every prefix.

The full-sequence causal forward (no cache) is the reference. The model is checked through a KV cache of
per-row positions in any chunk schedule, and the engine (eager and compiled) with requests joining and leaving
slots mid-run: every logit row the engine samples from is compared with the full forward of that request's
prompt and output so far.

Tolerances: fp32 logits agree to 1e-5 (max abs): only the order of floating-point sums differs (matmuls of
other shapes). bf16: with std=0.1 weights the logits stay below 4 in magnitude, where one bf16 ulp is 2**-6
(0.016); computations of other shapes round differently, measured up to 2 ulps (0.03). 0.08 (5 ulps) allows
that and stays far below what a wrong mask, position or slot causes (errors the size of the logits).
"""

import pytest
import torch

from conftest import FP32_ROUTES, TINY_CONFIGS, cached_logits, make_model
from generate.engine import Engine
from generate.request import Request
from generate.runner import decode_spans
from generate.sampling import SamplingParams
from model import GPTConfig

FP32_TOL = 1e-5
BF16_TOL = 0.08
GREEDY = SamplingParams(temperature=0)


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


def run_and_record(engine: Engine, requests: list[Request]) -> dict[int, list[torch.Tensor]]:
    """Run requests through the engine, keeping every logit row it sampled from, per request."""
    seen: dict[int, list[torch.Tensor]] = {id(r): [] for r in requests}
    choose = engine._choose

    def spy(logits, rows):
        for slot, i in rows.items():
            seen[id(engine.running[slot])].append(logits[i].float().clone())
        return choose(logits, rows)

    engine._choose = spy
    for r in requests:
        engine.add(r)
    for _ in engine.run():
        pass
    engine._choose = choose
    return seen


def assert_engine_matches_full_forward(model, requests, seen, tol):
    for r in requests:
        ids = torch.tensor([r.prompt + r.token_ids[:-1]])
        with torch.no_grad():
            full = model(ids)[0, len(r.prompt) - 1 :].float()  # the logits each chosen token came from
        got = torch.stack(seen[id(r)])
        assert got.shape == full.shape
        assert (got - full).abs().max().item() <= tol, r.prompt


def mixed_requests(config, seed, count=6):
    """Requests of varied lengths and budgets: with fewer slots than requests, rows join mid-run."""
    g = torch.Generator().manual_seed(seed)
    n = config.n_positions
    out = []
    for i in range(count):
        length = int(torch.randint(1, n - 12, (1,), generator=g))
        prompt = torch.randint(0, config.vocab_size, (length,), generator=g).tolist()
        out.append(Request(prompt, GREEDY, max_new_tokens=3 + 2 * i, eos_id=None))
    return out


@pytest.mark.parametrize("routes", FP32_ROUTES)
@pytest.mark.parametrize("seed", [0, 1])
def test_engine_with_rows_joining_mid_run_equals_full_forward_at_every_prefix(tiny_config, seed, routes):
    # Every eager fp32 route (F.linear, oneDNN, the head in row blocks: generate/kernels.py), forced.
    model = make_model(tiny_config, seed=seed, std=0.3)
    requests = mixed_requests(tiny_config, seed)
    engine = Engine(model, slots=2)
    for name, value in routes.items():
        setattr(engine.runner, name, value)
    seen = run_and_record(engine, requests)
    assert_engine_matches_full_forward(model, requests, seen, FP32_TOL)


@pytest.mark.parametrize("upcast_rows", [None, 1], ids=["bf16", "upcast"])
def test_bf16_engine_tracks_full_forward_at_every_prefix(tiny_config, upcast_rows):
    # Both eager bf16 routes: oneDNN's bf16 products, and fp32 on upcast weights (what CPUs without native
    # bf16 take, generate/kernels.py), whichever this machine would pick.
    model = make_model(tiny_config, seed=5, std=0.1).to(torch.bfloat16)
    requests = mixed_requests(tiny_config, 5)
    engine = Engine(model, slots=3)
    engine.runner.upcast_rows = upcast_rows
    seen = run_and_record(engine, requests)
    assert_engine_matches_full_forward(model, requests, seen, BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_engine_with_rows_joining_mid_run_equals_full_forward(dtype):
    config = TINY_CONFIGS["2x2x32"]
    model = make_model(config, seed=6, std=0.1 if dtype == torch.bfloat16 else 0.3).to(dtype)
    requests = mixed_requests(config, 6, count=5)
    seen = run_and_record(Engine(model, slots=2, compile=True), requests)
    assert_engine_matches_full_forward(
        model, requests, seen, FP32_TOL if dtype == torch.float32 else BF16_TOL
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_reading_the_span_of_its_rows_equals_full_forward_at_every_prefix(dtype):
    # A 256-position window: the eager step reads 64, 96, ... 256 positions as the furthest row needs
    # (generate/runner.py), here taken whatever the check at start found on this machine.
    config = GPTConfig(vocab_size=97, n_positions=256, n_embd=48, n_layer=2, n_head=3)
    model = make_model(config, seed=7, std=0.3 if dtype == torch.float32 else 0.1).to(dtype)
    requests = mixed_requests(config, 7, count=8)
    engine = Engine(model, slots=3)
    engine.runner.spans = decode_spans(256)
    seen = run_and_record(engine, requests)
    assert_engine_matches_full_forward(
        model, requests, seen, FP32_TOL if dtype == torch.float32 else BF16_TOL
    )
