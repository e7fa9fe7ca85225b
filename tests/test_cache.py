"""KVCache: sizes, per-slot in-place writes at each row's positions, and clearing a slot."""

import pytest
import torch

from helpers import TINY_CONFIGS, make_model
from model import GPTConfig, KVCache


def test_each_slot_is_written_in_place_at_its_own_positions():
    config = TINY_CONFIGS["5x3x48"]
    model = make_model(config)
    cache = KVCache(config, 2, 20)
    assert len(cache.k) == 5 and cache.k[0].shape == (2, 3, 64, 16)  # 20 positions in whole chunks
    assert cache.nbytes == 2 * 5 * 2 * 3 * 65 * 16 * 4  # (one position more in storage, never used)
    ptrs = [b.data_ptr() for b in cache.k]
    with torch.no_grad():
        model(torch.ones(1, 6, dtype=torch.long), positions=torch.arange(6)[None], cache=cache, slot=1)
        model(torch.ones(2, 1, dtype=torch.long), positions=torch.tensor([[0], [6]]), cache=cache)
    assert [b.data_ptr() for b in cache.k] == ptrs
    for k in cache.k:
        assert k[1, :, :7].abs().sum() > 0 and k[1, :, 7:].abs().sum() == 0  # slot 1: positions 0..6
        assert k[0, :, :1].abs().sum() > 0 and k[0, :, 1:].abs().sum() == 0  # slot 0: position 0 only


def test_clear_empties_one_slot_only():
    config = TINY_CONFIGS["2x2x32"]
    cache = KVCache(config, 3, 10)
    for b in (*cache.k, *cache.v):
        b.fill_(float("nan"))
    cache.lengths = [4, 5, 6]
    cache.clear(1)
    assert cache.lengths == [4, 0, 6]
    for b in (*cache.k, *cache.v):
        assert torch.equal(b[1], torch.zeros_like(b[1])) and b[0].isnan().all() and b[2].isnan().all()


def test_bytes_per_token_matches_presets():
    gpt2 = GPTConfig.from_preset("gpt2")
    assert KVCache.bytes_per_token(gpt2) == 2 * 12 * 768 * 4  # 73,728 bytes in fp32
    assert KVCache.bytes_per_token(gpt2, torch.bfloat16) == 36_864


def test_size_errors():
    config = TINY_CONFIGS["2x2x32"]
    with pytest.raises(ValueError, match=r"max_len must be in 1\.\.64"):
        KVCache(config, 1, 65)
    with pytest.raises(ValueError, match="slots must be positive, got 0"):
        KVCache(config, 0, 8)
