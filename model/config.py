"""GPTConfig: the hyperparameters of a GPT-2-family decoder, named as in Hugging Face's GPT2Config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from sys import float_info

# Activation names as in Hugging Face config.json files (GPT-2's, "gelu_new", is GELU's tanh approximation).
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu", "relu", "silu", "swish")


@dataclass(frozen=True)
class GPTConfig:
    """Hyperparameters of a GPT-2-style decoder, checked on construction (``ValueError`` names the field)."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # MLP width; None means 4 * n_embd, as in GPT-2
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner"):
            value = getattr(self, name)
            if name == "n_inner" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                hint = " or None (meaning 4 * n_embd)" if name == "n_inner" else ""
                raise ValueError(f"GPTConfig.{name} must be a positive integer{hint}, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                             f"choose n_head among the divisors of {self.n_embd}")  # fmt: skip
        eps = self.layer_norm_epsilon
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps <= float_info.max):
            raise ValueError(f"GPTConfig.layer_norm_epsilon must be a positive finite number, got {eps!r}")
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(f"GPTConfig.activation_function {self.activation_function!r} is not supported; "
                             f"use one of {', '.join(ACTIVATIONS)}")  # fmt: skip
        for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {value!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        """Width of the MLP's hidden layer."""
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @classmethod
    def from_preset(cls, name: str, **overrides: object) -> GPTConfig:
        """A published GPT-2 model's configuration (``name`` a key of :data:`PRESETS`), with ``overrides``."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; the presets are {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    "distilgpt2": GPTConfig(n_layer=6, n_head=12, n_embd=768),
}
