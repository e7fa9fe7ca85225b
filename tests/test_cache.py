"""KVCache: sizes, in-place writes, and dropping leading positions."""

import pytest
import torch

from conftest import TINY_CONFIGS, make_model
from model import GPTConfig, KVCache


def test_buffers_are_preallocated_and_written_in_place():
    config = TINY_CONFIGS["5x3x48"]
    model = make_model(config)
    cache = KVCache(config, 2, 20)
    assert cache.k.shape == (5, 2, 3, 20, 16) and cache.nbytes == 2 * 5 * 2 * 3 * 20 * 16 * 4
    k_ptr = cache.k.data_ptr()
    with torch.no_grad():
        model(torch.ones(2, 6, dtype=torch.long), cache=cache)
        model(torch.ones(2, 1, dtype=torch.long), cache=cache)
    assert cache.length == 7 and cache.k.data_ptr() == k_ptr
    assert cache.k[:, :, :, :7].abs().sum() > 0 and cache.k[:, :, :, 7:].abs().sum() == 0


def test_bytes_per_token_matches_presets():
    gpt2 = GPTConfig.from_preset("gpt2")
    assert KVCache.bytes_per_token(gpt2) == 2 * 12 * 768 * 4  # 73,728 bytes in fp32
    assert KVCache.bytes_per_token(gpt2, torch.bfloat16) == 36_864


def test_drop_front_moves_the_rest_forward():
    config = TINY_CONFIGS["2x2x32"]
    cache = KVCache(config, 1, 10)
    cache.k[:, :, :, :6] = torch.arange(6.0)[:, None]
    cache.length = 6
    cache.drop_front(2)
    assert cache.length == 4
    assert torch.equal(cache.k[0, 0, 0, :4, 0], torch.tensor([2.0, 3.0, 4.0, 5.0]))
    with pytest.raises(ValueError, match=r"can drop 0\.\.4 cached positions, not 5"):
        cache.drop_front(5)


def test_size_errors():
    config = TINY_CONFIGS["2x2x32"]
    with pytest.raises(ValueError, match=r"max_len must be in 1\.\.64"):
        KVCache(config, 1, 65)
    with pytest.raises(ValueError, match="batch_size must be positive, got 0"):
        KVCache(config, 0, 8)
