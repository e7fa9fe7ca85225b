"""Reading and writing Hugging Face GPT-2 ``config.json`` files as :class:`model.GPTConfig`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from checkpoints.errors import CheckpointError
from checkpoints.safetensors_io import read_small_file
from checkpoints.tokenizer import EOT_ID
from model import GPTConfig

MAX_CONFIG_BYTES = 2**20  # real ones are about 1 KB; a bound keeps a huge or endless file from being read

_FIELDS = tuple(f.name for f in dataclasses.fields(GPTConfig))
# Options of GPT2Config that change the computation in ways this model does not implement, with the value
# under which the file still describes plain GPT-2.
_UNSUPPORTED = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}

# Other names transformers' GPT2Config accepts for four fields (its attribute_map).
_ALIASES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
            "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}  # fmt: skip


def config_from_dict(raw: dict[str, Any], *, source: str = "config") -> GPTConfig:
    """Build a :class:`GPTConfig` from a GPT-2 ``config.json`` dictionary.

    Missing fields take GPT2Config's defaults; fields this model has no use for (tokenizer ids,
    ``summary_*``, ``architectures``...) are ignored.

    Raises:
        CheckpointError: if the config is for another architecture, asks for an unsupported option, or
            has impossible values.
    """
    model_type = raw.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise CheckpointError(
            f"{source}: model_type is {model_type!r}; only 'gpt2' checkpoints are supported"
        )
    for key, plain in _UNSUPPORTED.items():
        if key in raw and raw[key] != plain:
            raise CheckpointError(f"{source}: {key}={raw[key]!r} is not supported (only {plain!r} is)")
    values = {name: raw[name] for name in _FIELDS if name in raw}
    for alias, name in _ALIASES.items():  # (GPT2Config's attribute_map: transformers reads these too)
        if alias in raw and name in raw and raw[alias] != raw[name]:
            raise CheckpointError(f"{source}: {name}={raw[name]!r} but {alias}={raw[alias]!r}, which names "
                                  "the same setting; keep one of them")  # fmt: skip
        if alias in raw:
            values[name] = raw[alias]
    if "n_positions" not in values and "n_ctx" in raw:  # very old configs name the window n_ctx
        values["n_positions"] = raw["n_ctx"]
    try:
        return GPTConfig(**values)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from e


def read_config(path: Path) -> GPTConfig:
    """Read a ``config.json`` file.

    Raises:
        CheckpointError: if the file is missing, unreadable, not a regular file, over 1 MiB, not a JSON
            object, or has impossible values.
    """
    try:
        text = read_small_file(path, MAX_CONFIG_BYTES, "a config.json").decode("utf-8")
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} does not exist; a checkpoint directory needs a config.json") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); fix or regenerate it"
        ) from e
    except RecursionError as e:
        raise CheckpointError(f"{path} nests JSON too deeply to be a config; fix or regenerate it") from e
    except ValueError as e:  # (an integer of more digits than Python converts)
        raise CheckpointError(f"{path} is not a config: {e}; fix or regenerate it") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(raw).__name__}")
    return config_from_dict(raw, source=str(path))


def config_to_dict(config: GPTConfig, *, dtype: str) -> dict[str, Any]:
    """The ``config.json`` contents that ``transformers.GPT2LMHeadModel.from_pretrained`` reads."""
    out: dict[str, Any] = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **dataclasses.asdict(config),
        "tie_word_embeddings": True,
        "dtype": dtype,
    }
    if config.vocab_size > EOT_ID:  # GPT-2's vocabulary: <|endoftext|> begins and ends documents
        out["bos_token_id"] = out["eos_token_id"] = EOT_ID
    return out
