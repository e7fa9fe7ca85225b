"""Tiny checkpoints for the checkpoint tests: random GPT-2 models built and saved here, never downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

import checkpoints
from model import GPT, GPTConfig


def hf_model(seed: int = 0, **config: object) -> transformers.GPT2LMHeadModel:
    """A randomly initialised ``GPT2LMHeadModel`` in eval mode, fp32.

    Every parameter (biases and LayerNorms included) is perturbed away from its init, so a weight that is
    dropped, transposed or misplaced on load changes the logits.
    """
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(bos_token_id=0, eos_token_id=0, **config))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def save_hf(directory: Path, seed: int = 0, **config: object) -> transformers.GPT2LMHeadModel:
    """Build :func:`hf_model` and ``save_pretrained`` it (safetensors) to ``directory``."""
    model = hf_model(seed, **config)
    model.save_pretrained(directory)
    return model


def random_ids(vocab_size: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """(batch, length) token ids drawn with their own generator."""
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def assert_same_logits(ours: GPT, hf: transformers.GPT2LMHeadModel, ids: torch.Tensor, atol: float) -> None:
    """Our logits equal Hugging Face's on ``ids`` within ``atol`` (both in fp32)."""
    expected = hf(ids).logits
    actual = ours(ids)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def tiny_checkpoint(directory: Path) -> tuple[Path, GPT]:
    """A 1-layer checkpoint (vocab 50, width 32) written by our own ``save``; fast, and in the HF layout."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_positions=8, n_embd=32, n_layer=1, n_head=2)).eval()
    return checkpoints.save(model, directory), model
