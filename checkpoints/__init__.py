"""checkpoints: everything on disk: safetensors checkpoints (Hugging Face GPT-2 layout), the tokenizer."""

from checkpoints.errors import CheckpointError
from checkpoints.load import INT8_MODES, QUANT_MODES, load, shipped_names
from checkpoints.placement import resolve_device, resolve_dtype
from checkpoints.save import save
from checkpoints.tokenizer import EOT_ID, load_tokenizer

__all__ = [
    "EOT_ID",
    "INT8_MODES",
    "QUANT_MODES",
    "CheckpointError",
    "load",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
    "save",
    "shipped_names",
]
