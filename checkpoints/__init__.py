"""checkpoints: everything on disk: safetensors checkpoints (Hugging Face GPT-2 layout), the tokenizer."""

from checkpoints.errors import CheckpointError
from checkpoints.load import load, resolve_dtype, shipped_names
from checkpoints.save import save
from checkpoints.tokenizer import EOT_ID, load_tokenizer

__all__ = ["EOT_ID", "CheckpointError", "load", "load_tokenizer", "resolve_dtype", "save", "shipped_names"]
