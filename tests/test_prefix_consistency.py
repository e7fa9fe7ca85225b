"""The prefix-consistency suite: cached incremental decoding equals the full-sequence forward at every prefix.

The full-sequence causal forward (no cache) is the reference. Tolerances: fp32 logits agree to 1e-5 (max abs);
they differ only by the order of floating-point sums in matmuls of different shapes.
"""

import pytest
import torch

import model.linear
from conftest import TINY_CONFIGS, make_model
from model import KVCache

FP32_TOL = 1e-5


def decode_logits(model, ids, chunks, attention_mask=None):
    """Logits for every position of ``ids`` computed through the cache, ``chunks`` positions at a time."""
    cache = KVCache(model.config, ids.shape[0], ids.shape[1], dtype=model.wte.weight.dtype)
    out, start = [], 0
    for size in chunks:
        end = start + size
        mask = None if attention_mask is None else attention_mask[:, :end]
        out.append(model(ids[:, start:end], cache=cache, attention_mask=mask))
        start = end
    assert cache.length == ids.shape[1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_then_one_token_at_a_time_equals_full_forward(tiny_config, seed, fp32_products):
    model = make_model(tiny_config, seed=seed)
    torch.manual_seed(seed + 10)
    n = tiny_config.n_positions
    ids = torch.randint(0, tiny_config.vocab_size, (2, n))
    with torch.no_grad():
        full = model(ids)
        for prefill in (1, 5, n - 1):  # each prefix length t is checked at its own decode step
            cached = decode_logits(model, ids, [prefill] + [1] * (n - prefill))
            assert (cached - full).abs().max().item() <= FP32_TOL, prefill


def test_every_prefix_alone_equals_full_forward_row(tiny_config, fp32_products):
    model = make_model(tiny_config, seed=3)
    n = tiny_config.n_positions
    ids = torch.randint(0, tiny_config.vocab_size, (1, n), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        for t in range(1, n + 1):
            last = model(ids[:, :t], last_only=True)[:, -1]
            assert (last - full[:, t - 1]).abs().max().item() <= FP32_TOL, t


@pytest.mark.parametrize("chunks", [[3, 1, 7, 2, 11, 1], [1, 16, 2, 5], [13, 13, 3]])
def test_uneven_chunked_prefill_equals_full_forward(chunks, fp32_products):
    config = TINY_CONFIGS["5x3x48"]
    model = make_model(config, seed=4)
    ids = torch.randint(0, config.vocab_size, (3, sum(chunks)), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (decode_logits(model, ids, chunks) - model(ids)).abs().max().item() <= FP32_TOL


def left_pad(prompts, pad_id=0):
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    return ids, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_left_padded_batch_rows_equal_each_prompt_alone(tiny_config, seed, fp32_products):
    model = make_model(tiny_config, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 30, 7] if tiny_config.n_positions > 40 else [1, 30, 7][:2]
    prompts = [torch.randint(0, tiny_config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    steps = 8
    continuation = torch.randint(0, tiny_config.vocab_size, (len(prompts), steps), generator=g)
    ids, mask = left_pad(prompts)
    longest = ids.shape[1]
    ids = torch.cat([ids, continuation], dim=1)
    mask = torch.cat([mask, torch.ones_like(continuation)], dim=1)
    with torch.no_grad():
        batched = decode_logits(model, ids, [longest] + [1] * steps, attention_mask=mask)
        assert torch.isfinite(batched).all()  # padding rows included: no NaN anywhere
        for i, p in enumerate(prompts):
            alone = model(torch.tensor([p + continuation[i].tolist()]))[0]
            # every real position of row i, the prompt and each decode step
            assert (batched[i, longest - len(p) :] - alone).abs().max().item() <= FP32_TOL, i


def test_bf16_cached_decoding_tracks_full_forward(bf16_products):
    # Weights with std 0.1 give logits of magnitude up to ~3, where one bf16 ulp is 2**-6 (0.016). Two
    # computations of the same logits with matmuls of different shapes round differently: measured here,
    # up to 2 ulps (0.03). 0.08 (5 ulps) allows that and is still far below what a wrong mask or position
    # causes (differences of the order of the logits themselves).
    config = TINY_CONFIGS["5x3x48"]
    tol = 0.08
    for seed in (5, 6):
        model = make_model(config, seed=seed, std=0.1).to(torch.bfloat16)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, config.vocab_size, (2, config.n_positions), generator=g)
        with torch.no_grad():
            full = model(ids).float()
            cached = decode_logits(model, ids, [4] + [1] * (config.n_positions - 4)).float()
            reference = make_model(config, seed=seed, std=0.1)(ids)  # the same weights in fp32
        assert (cached - full).abs().max().item() <= tol
        assert (full - reference).abs().max().item() <= tol
        assert (cached.argmax(-1) == full.argmax(-1)).float().mean() >= 0.95


# bf16 tolerance, for the two tests below as for the one above: with std=0.1 weights the logits stay below 4
# in magnitude (3.2 at most over these configs and seeds), where one bf16 ulp is 2**-6 (0.016). The cached
# and full forwards round differently because their matmuls have different shapes (chunks of 1..n rows,
# batches of 1 or 3 rows); measured over 36 models here: up to 0.029 (2 ulps). 0.08 (5 ulps) allows that
# and stays far below what a wrong mask, position or cache offset causes (errors the size of the logits).
BF16_TOL = 0.08


@pytest.fixture(params=["upcast", "emulated"])
def bf16_products(request, monkeypatch):
    """Both CPU routes of bf16 products, whatever this CPU has: many-row products computed in fp32 on
    upcast weights (as without native bf16) or all of them in bf16 kernels (as with it)."""
    monkeypatch.setattr(model.linear, "_bf16_emulated", lambda: request.param == "upcast")
    return request.param


def random_chunks(total, g):
    """A random schedule of chunk sizes summing to ``total``, drawn from the generator ``g``."""
    chunks = []
    while sum(chunks) < total:
        chunks.append(int(torch.randint(1, total - sum(chunks) + 1, (1,), generator=g)))
    return chunks


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_bf16_chunked_prefill_tracks_full_forward(tiny_config, seed, bf16_products):
    model = make_model(tiny_config, seed=seed, std=0.1).to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    n = tiny_config.n_positions
    ids = torch.randint(0, tiny_config.vocab_size, (3, n), generator=g)
    chunks = random_chunks(n, g)
    assert len(chunks) > 1  # a real chunked prefill, not one full-sequence call
    with torch.no_grad():
        full = model(ids).float()
        cached = decode_logits(model, ids, chunks).float()
    assert full.abs().max().item() < 4  # the scale the tolerance was derived for
    assert (cached - full).abs().max().item() <= BF16_TOL, chunks
    assert (cached.argmax(-1) == full.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("seed", [7, 8])
def test_bf16_left_padded_batch_rows_track_each_row_alone(tiny_config, seed, bf16_products):
    model = make_model(tiny_config, seed=seed, std=0.1).to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    n = tiny_config.n_positions
    steps = 4
    lengths = [1, n - steps, 7, n // 2]
    prompts = [torch.randint(0, tiny_config.vocab_size, (k,), generator=g).tolist() for k in lengths]
    continuation = torch.randint(0, tiny_config.vocab_size, (len(prompts), steps), generator=g)
    ids, mask = left_pad(prompts)
    longest = ids.shape[1]
    ids = torch.cat([ids, continuation], dim=1)
    mask = torch.cat([mask, torch.ones_like(continuation)], dim=1)
    agree = []
    with torch.no_grad():
        # a chunked prefill of the padded prompts (chunks start inside the padding), then one at a time
        schedule = random_chunks(longest, g) + [1] * steps
        batched = decode_logits(model, ids, schedule, attention_mask=mask).float()
        assert torch.isfinite(batched).all()
        for i, p in enumerate(prompts):
            alone = model(torch.tensor([p + continuation[i].tolist()]))[0].float()  # bf16, full sequence
            assert alone.abs().max().item() < 4
            row = batched[i, longest - len(p) :]
            assert (row - alone).abs().max().item() <= BF16_TOL, (i, schedule)
            agree.append(row.argmax(-1) == alone.argmax(-1))
    assert torch.cat(agree).float().mean() >= 0.95
