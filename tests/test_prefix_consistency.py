"""The prefix-consistency suite: cached incremental decoding equals the full-sequence forward at every prefix.

The full-sequence causal forward (no cache) is the reference. Tolerances: fp32 logits agree to 1e-5 (max abs);
they differ only by the order of floating-point sums in matmuls of different shapes.
"""

import pytest
import torch

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
def test_prefill_then_one_token_at_a_time_equals_full_forward(tiny_config, seed):
    model = make_model(tiny_config, seed=seed)
    torch.manual_seed(seed + 10)
    n = tiny_config.n_positions
    ids = torch.randint(0, tiny_config.vocab_size, (2, n))
    with torch.no_grad():
        full = model(ids)
        for prefill in (1, 5, n - 1):  # each prefix length t is checked at its own decode step
            cached = decode_logits(model, ids, [prefill] + [1] * (n - prefill))
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
def test_left_padded_batch_rows_equal_each_prompt_alone(tiny_config, seed):
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


def test_bf16_cached_decoding_tracks_full_forward():
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
