"""Shared tiny configurations for the test suite."""

from __future__ import annotations

import pytest
import torch

from generate.kernels import onednn_available
from model import GPT, GPTConfig

# Small but varied shapes: odd head counts, short windows, a non-default MLP width and activation.
TINY_CONFIGS = {
    "2x2x32": GPTConfig(vocab_size=211, n_positions=64, n_embd=32, n_layer=2, n_head=2),
    "5x3x48": GPTConfig(vocab_size=97, n_positions=40, n_embd=48, n_layer=5, n_head=3),
    "1x1x16-relu": GPTConfig(
        vocab_size=50, n_positions=48, n_embd=16, n_layer=1, n_head=1, n_inner=24, activation_function="relu"
    ),
}

# For int4 (its group sizes must divide every linear layer's input width): 64 and 256, a 97-token vocabulary
# (a head padded to 128 rows), and TINY_CONFIGS["5x3x48"]'s vocabulary and window.
INT4_CONFIG = GPTConfig(vocab_size=97, n_positions=40, n_embd=64, n_layer=3, n_head=2)


# The eager decode step's fp32 routes (generate/kernels.py), forced on a runner with setattr: F.linear,
# oneDNN where this build has it, and the head and the linear layers in row blocks (the vocabularies, of 50,
# 97 and 211 tokens, leave head rows past 4 whole blocks: the blocks overlap there).
FP32_ROUTES = [
    pytest.param({"onednn": False, "head_blocks": None, "body_blocks": None}, id="aten"),
    pytest.param(
        {"onednn": True, "head_blocks": None, "body_blocks": None},
        id="onednn",
        marks=pytest.mark.skipif(not onednn_available(), reason="no oneDNN"),
    ),
    pytest.param({"onednn": False, "head_blocks": 4, "body_blocks": 2}, id="blocks"),
]


def make_model(config: GPTConfig, seed: int = 0, std: float = 0.02) -> GPT:
    """A randomly initialised model in eval mode. A larger ``std`` gives clear argmax margins."""
    torch.manual_seed(seed)
    model = GPT(config)
    if std != 0.02:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2 or "ln" not in name:
                    p.normal_(0.0, std)
    return model.eval()


def greedy_by_recomputation(model: GPT, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: rerun the whole sequence through the uncached forward for every new token."""
    ids = list(prompt)
    with torch.no_grad():
        while len(ids) - len(prompt) < max_new_tokens and len(ids) < model.config.n_positions:
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(params=sorted(TINY_CONFIGS), ids=sorted(TINY_CONFIGS))
def tiny_config(request: pytest.FixtureRequest) -> GPTConfig:
    """Each tiny configuration in turn."""
    return TINY_CONFIGS[request.param]


# The models here are tiny: one thread is faster than two, and it leaves the other core to a parallel job.
torch.set_num_threads(1)


def cached_logits(
    model: GPT, ids: torch.Tensor, chunks: list[int], max_len: int | None = None
) -> torch.Tensor:
    """Logits for every position of ``ids`` (B, T) computed through a KV cache, ``chunks`` positions at a
    time, every row in its own slot at explicit positions."""
    from model import KVCache

    b, t = ids.shape
    cache = KVCache(model.config, b, max_len or t, dtype=model.compute_dtype)
    out, start = [], 0
    for size in chunks:
        positions = torch.arange(start, start + size).expand(b, -1)
        out.append(model(ids[:, start : start + size], positions=positions, cache=cache))
        start += size
    assert start == t
    return torch.cat(out, dim=1)


@pytest.fixture(autouse=True, scope="session")
def _compiled_steps_in_pytest_cache(pytestconfig):
    """Compiled decode steps go to pytest's cache directory (kept between local runs, fresh in CI), never
    to the user's own cache; subprocesses (the CLI) inherit it."""

    mp = pytest.MonkeyPatch()
    mp.setenv("GPTGEN_CACHE_DIR", str(pytestconfig.cache.mkdir("gptgen")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """A tiny saved checkpoint with GPT-2's whole vocabulary, so any text encodes: 1 layer, width 16, a
    32-token window, clear argmax margins (std 0.3)."""
    import checkpoints

    directory = tmp_path_factory.mktemp("text_ckpt")
    model = make_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32), std=0.3)
    checkpoints.save(model, directory)
    return directory
