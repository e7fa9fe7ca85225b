"""GPTConfig: validation and presets."""

import pytest

from model import PRESETS, GPTConfig


def test_defaults_are_gpt2_small():
    c = GPTConfig()
    assert (c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head) == (50257, 1024, 768, 12, 12)
    assert c.head_dim == 64 and c.inner_dim == 3072


@pytest.mark.parametrize(
    ("name", "layers", "heads", "width"),
    [("gpt2", 12, 12, 768), ("gpt2-medium", 24, 16, 1024), ("gpt2-large", 36, 20, 1280),
     ("gpt2-xl", 48, 25, 1600), ("distilgpt2", 6, 12, 768)],
)  # fmt: skip
def test_presets(name, layers, heads, width):
    c = GPTConfig.from_preset(name)
    assert (c.n_layer, c.n_head, c.n_embd) == (layers, heads, width)
    assert set(PRESETS) == {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2"}


def test_preset_overrides_and_exact_names():
    assert GPTConfig.from_preset("gpt2", n_positions=128).n_positions == 128
    for fuzzy in ("GPT2", "gpt2-med", "gpt-2", "gpt2 "):
        with pytest.raises(ValueError, match="unknown preset"):
            GPTConfig.from_preset(fuzzy)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"n_embd": 100, "n_head": 3}, r"n_embd \(100\) must be divisible by n_head \(3\)"),
        ({"n_layer": 0}, "n_layer must be a positive integer, got 0"),
        ({"vocab_size": -5}, "vocab_size must be a positive integer"),
        ({"n_positions": 2.5}, "n_positions must be a positive integer"),
        ({"n_inner": 0}, "n_inner must be a positive integer or None"),
        ({"activation_function": "swiglu"}, "activation_function 'swiglu' is not supported; use one of"),
        ({"attn_pdrop": 1.0}, r"attn_pdrop must be in \[0, 1\)"),
        ({"layer_norm_epsilon": 0}, "layer_norm_epsilon must be a positive finite number"),
        (
            {"layer_norm_epsilon": float("inf")},
            "layer_norm_epsilon must be a positive finite number, got inf",
        ),
        (
            {"layer_norm_epsilon": float("nan")},
            "layer_norm_epsilon must be a positive finite number, got nan",
        ),
        ({"layer_norm_epsilon": True}, "layer_norm_epsilon must be a positive finite number, got True"),
        ({"layer_norm_epsilon": 10**400}, "layer_norm_epsilon must be a positive finite number, got 1000"),
    ],
)
def test_invalid_values_name_the_field_and_fix(changes, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**changes)
