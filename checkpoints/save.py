"""Save a GPT in the Hugging Face GPT-2 layout (``config.json`` + ``model.safetensors``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from checkpoints.hf_config import config_to_dict
from checkpoints.load import INDEX_FILE, SINGLE_FILE
from checkpoints.placement import resolve_dtype
from checkpoints.safetensors_io import write_safetensors
from model import GPT
from model.int4 import Int4Linear, Int4TiedEmbedding
from model.quant import Int8Linear, Int8TiedEmbedding

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _remove_stale_shards(directory: Path) -> None:
    # A sharded checkpoint being replaced by a single file: its index and shards would make the directory
    # ambiguous, so they go (only the files the index names inside this directory).
    index = directory / INDEX_FILE
    if not index.exists():
        return
    try:
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        shards = set()
    for name in shards:
        shard = directory / str(name)
        if shard.parent == directory and shard.name.endswith(".safetensors") and shard.name != SINGLE_FILE:
            shard.unlink(missing_ok=True)
    index.unlink()


def save(model: GPT, directory: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None) -> Path:
    """Write ``model`` to ``directory`` so that both :func:`checkpoints.load` and
    ``transformers.GPT2LMHeadModel.from_pretrained(directory)`` read it.

    Each file is written to a temporary name and renamed into place, so an interrupted save never leaves a
    half-written file under the final name; the config is written first, so a save that fails (a full disk,
    a folder in the way) leaves the old pair as it was.

    Args:
        model: the model to save.
        directory: created if needed; an existing ``config.json`` / ``model.safetensors`` is replaced.
        dtype: the dtype to store the weights in (default: the model's own), e.g. ``"bfloat16"`` to halve
            the file.

    Returns:
        The directory.

    Raises:
        ValueError: for an empty ``directory``, an unsupported ``dtype``, or an int8- or int4-quantized model
            (its linear layers hold quantized matrices and scales, which the GPT-2 layout has no place for).
        OSError: if the files cannot be written (a read-only or full disk), whatever layer failed.
    """
    if not isinstance(model, GPT):
        raise ValueError(f"model must be a model.GPT, got {type(model).__name__} (a Generator's: gen.model)")
    if not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"directory={directory!r} must be a path (a str or os.PathLike)")
    if isinstance(directory, str) and not directory.strip():
        raise ValueError('the directory to save into is empty; give a directory path ("." for this one)')
    quantized = {Int8Linear: "int8", Int8TiedEmbedding: "int8", Int4Linear: "int4", Int4TiedEmbedding: "int4"}
    kind = next((quantized[type(m)] for m in model.modules() if type(m) in quantized), None)
    if kind is not None:
        raise ValueError(
            f"this model is {kind}-quantized (loaded with dtype='{kind}' or '{kind}-body'): its {kind} "
            "matrices cannot be stored as GPT-2 weights; save the model loaded in float32 or bfloat16 instead"
        )
    directory = Path(directory)
    store = resolve_dtype(dtype) if dtype is not None else model.wte.weight.dtype
    resolve_dtype(store)
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", SINGLE_FILE):  # (before either is replaced: the pair stays whole)
        if (directory / name).is_dir():
            raise IsADirectoryError(f"{directory / name} is a directory; remove it, or save elsewhere")
    config = json.dumps(config_to_dict(model.config, dtype=_DTYPE_NAMES[store]), indent=2) + "\n"
    tmp = directory / f".config.json.tmp-{os.getpid()}"
    try:
        tmp.write_text(config, encoding="utf-8")  # (first: a full disk fails here, the old pair intact)
        state = {name: p.detach().to(device="cpu", dtype=store) for name, p in model.named_parameters()}
        write_safetensors(state, directory / SINGLE_FILE)
        _remove_stale_shards(directory)
        os.replace(tmp, directory / "config.json")
    finally:
        tmp.unlink(missing_ok=True)
    return directory
