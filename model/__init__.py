"""model: the GPT-2-family decoder in pure torch.nn (no file or network I/O)."""

from model.attention import CausalAttention
from model.cache import KVCache
from model.config import PRESETS, GPTConfig
from model.gpt import GPT

__all__ = ["GPT", "PRESETS", "CausalAttention", "GPTConfig", "KVCache"]
