"""Fixtures for the test suite (helpers live in helpers.py)."""

from __future__ import annotations

import os

# The suite's two workers share two cores, so a thread waiting at a barrier sleeps rather than spins (GNU
# OpenMP's setting, read when torch loads; subprocesses inherit it): spinning, a test of two threads or a
# subprocess using both cores ran up to 20x slower beside the other worker.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch.compile's C++ kernels (tested on the CPU) without precompiled headers: inductor keeps them in /tmp.
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")

import pytest
import torch

from helpers import TINY_CONFIGS, make_model
from model import GPTConfig


@pytest.fixture(params=sorted(TINY_CONFIGS), ids=sorted(TINY_CONFIGS))
def tiny_config(request: pytest.FixtureRequest) -> GPTConfig:
    """Each tiny configuration in turn."""
    return TINY_CONFIGS[request.param]


# The models here are tiny: one thread is faster than two, and it leaves the other core to a parallel job.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test its own cache directory (compiled steps, inductor's caches), never the user's own;
    subprocesses (the CLI) inherit it. Tests that share a compile set GPTGEN_CACHE_DIR themselves."""
    directory = tmp_path_factory.mktemp("gptgen-cache")
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(directory))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(directory / "inductor"))  # (torch.compile's: CUDA's)


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """A tiny saved checkpoint with GPT-2's whole vocabulary, so any text encodes: 1 layer, width 16, a
    32-token window, clear argmax margins (std 0.3)."""
    import checkpoints

    directory = tmp_path_factory.mktemp("text_ckpt")
    model = make_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32), std=0.3)
    checkpoints.save(model, directory)
    return directory


# The slowest modules first (each runs whole on one of the two workers), so no worker ends alone on one.
SLOW_FIRST = ("test_shipped", "test_batch_ray", "test_speculate", "test_server", "test_compiled",
              "test_prefix_consistency")  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the modules slowest first (a stable sort: the order within a module is kept)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(SLOW_FIRST)))
