"""Safetensors files in the Hugging Face GPT-2 layout: header checks, key mapping, reading and writing.

Weights are only ever read as safetensors data (never ``torch.load``/pickle), one tensor at a time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from checkpoints.errors import CheckpointError

# Safetensors dtype codes a checkpoint may store its weights in.
FILE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
# GPT-2 checkpoints store these four matrices as Conv1D weights, (in, out): nn.Linear wants (out, in).
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Buffers that older GPT-2 checkpoints carry (the causal mask and its fill value): rebuilt, never read.
LEGACY_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
PREFIX = "transformer."
_MAX_HEADER = 100 * 1024 * 1024


def read_header(path: Path) -> dict[str, dict]:
    """Validate a safetensors file's header against its size and return ``{name: {dtype, shape, ...}}``.

    Raises:
        CheckpointError: if the file is unreadable, not a regular file, too short, not safetensors, truncated,
            or its tensors' byte ranges overlap or leave gaps (the safetensors library's own rule).
    """
    try:
        size = check_regular_file(path).st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path} is {size} bytes, too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise CheckpointError(
                    f"{path} is not a complete safetensors file: its header claims {header_len} bytes but "
                    f"the file has only {size - 8} after the length field (truncated, or another format)"
                )
            if header_len > _MAX_HEADER:
                raise CheckpointError(f"{path}: header of {header_len} bytes is implausibly large")
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # (not UTF-8, not JSON, a huge integer; absurd nesting)
        raise CheckpointError(
            f"{path} is not a safetensors file: its header is not valid JSON ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    end = 0
    for name, info in header.items():
        if not _valid_entry(info):
            raise CheckpointError(
                f"{path} is not a valid safetensors file: header entry {name!r} needs a dtype string, "
                "a shape list of integers and two integer data_offsets"
            )
        end = max(end, info["data_offsets"][1])
        begin, stop = info["data_offsets"]  # (checked before anything is allocated for the shape)
        need = math.prod(info["shape"]) * _ITEMSIZE.get(info["dtype"], 0)
        if info["dtype"] in _ITEMSIZE and stop - begin != need:  # (other dtypes are refused by name)
            raise CheckpointError(f"cannot read {path} as safetensors: tensor {name} spans {stop - begin} "
                                  f"bytes but {info['dtype']} {info['shape']} needs {need}")  # fmt: skip
    _check_ranges(path, header)
    if 8 + header_len + end > size:
        raise CheckpointError(
            f"{path} is truncated: its tensors need {8 + header_len + end} bytes but the file has {size}"
        )
    if 8 + header_len + end < size:  # (as the safetensors library refuses it: not one whole file)
        raise CheckpointError(
            f"{path} is not a valid safetensors file: {size - 8 - header_len - end} bytes follow its data "
            f"(its tensors end at byte {8 + header_len + end} of {size}); it may have been written over "
            "another file, so write it again"
        )
    return header


def check_regular_file(path: Path) -> os.stat_result:
    """``path``'s status, if it is a regular file (or a link to one): a FIFO or a device would block or never
    end when read.

    Raises:
        CheckpointError: naming what it is instead.
        OSError: if it cannot be examined (missing, no permission).
    """
    status = path.stat()
    if not stat.S_ISREG(status.st_mode):
        kind = "a directory" if stat.S_ISDIR(status.st_mode) else "a FIFO, socket or device"
        raise CheckpointError(f"{path} is {kind}, not a regular file; give the path of the file itself")
    return status


def read_small_file(path: Path, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (a JSON file beside the weights).

    Raises:
        CheckpointError: if it is not a regular file, or longer than ``limit`` (it is then not ``what``).
        OSError: if it cannot be read.
    """
    check_regular_file(path)
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path} holds more than {limit:,} bytes: not {what}")
    return data


def _check_ranges(path: Path, header: dict[str, dict]) -> None:
    """Tensors' byte ranges must follow one another from 0, without overlap or gap, as in the safetensors
    library (it refuses other files): two tensors sharing bytes would alias each other's weights."""
    position = 0
    for begin, stop, name in sorted((*info["data_offsets"], name) for name, info in header.items()):
        if begin != position or stop < begin:
            raise CheckpointError(
                f"{path} is not a valid safetensors file: tensor {name!r} occupies bytes {begin}..{stop} "
                f"of the data but the tensors before it end at byte {position} (tensors must follow one "
                "another without overlap or gap)"
            )
        position = stop


def _valid_entry(info: object) -> bool:
    def ints(values: object) -> bool:
        return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)

    return (
        isinstance(info, dict)
        and isinstance(info.get("dtype"), str)
        and ints(info.get("shape"))
        and ints(info.get("data_offsets"))
        and len(info["data_offsets"]) == 2
    )


def model_key(file_key: str) -> str | None:
    """Map a checkpoint key to our parameter name; None for keys that are not read (legacy buffers, head)."""
    key = file_key.removeprefix(PREFIX)
    if key.endswith(LEGACY_BUFFER_SUFFIXES) or key == "lm_head.weight":
        return None  # the head is tied to wte, as GPT-2 ties it
    return key


def file_shape(model_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a parameter of ours has in a GPT-2 checkpoint (Conv1D weights are transposed)."""
    return tuple(reversed(shape)) if model_name.endswith(CONV1D_SUFFIXES) else tuple(shape)


# Bytes read per piece: the most of a tensor held in memory beside the model while loading.
CHUNK_BYTES = 16 * 2**20

Index = tuple[slice, ...]


def iter_tensors(path: Path, names: dict[str, str]) -> Iterator[tuple[str, Index, torch.Tensor]]:
    """Yield ``(model_name, index, piece)`` for the file keys in ``names`` ({file_key: model_name}).

    The caller copies each piece into place: ``param[index].copy_(piece)``. A tensor comes in pieces of
    whole rows (of the file's first dimension) of at most ``CHUNK_BYTES``, read with plain reads
    (safetensors data is raw little-endian arrays at the header's offsets), so no more than one piece is in
    memory beside the model, and no memory map's pages count toward the process's resident memory. Conv1D
    weights, stored ``(in, out)``, come back as transposed pieces with an index into ``(out, in)``.
    """
    header = read_header(path)
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            for file_key, name in names.items():
                info = header[file_key]
                dtype, shape = FILE_DTYPES[info["dtype"]], info["shape"]
                begin, end = info["data_offsets"]
                size = end - begin  # (read_header checked it against the shape)
                if not shape or size == 0:  # a scalar or an empty tensor: one piece
                    f.seek(8 + header_len + begin)
                    data = bytearray(f.read(size))
                    if len(data) != size:
                        raise CheckpointError(f"{path} is truncated inside tensor {file_key}")
                    whole = torch.frombuffer(data, dtype=dtype) if size else torch.empty(0, dtype=dtype)
                    yield name, (), whole.reshape(shape)
                    continue
                row_bytes = size // shape[0]
                step = max(1, CHUNK_BYTES // row_bytes)
                f.seek(8 + header_len + begin)
                for start in range(0, shape[0], step):
                    rows = min(step, shape[0] - start)
                    data = bytearray(rows * row_bytes)
                    if f.readinto(data) != len(data):
                        raise CheckpointError(f"{path} is truncated inside tensor {file_key}")
                    piece = torch.frombuffer(data, dtype=dtype).reshape(rows, *shape[1:])
                    if name.endswith(CONV1D_SUFFIXES):
                        yield name, (slice(None), slice(start, start + rows)), piece.t()
                    else:
                        yield name, (slice(start, start + rows),), piece
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


def write_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``{our_name: tensor}`` in the Hugging Face GPT-2 layout, atomically (temp file, then rename)."""
    tensors = {
        PREFIX + name: (t.t() if name.endswith(CONV1D_SUFFIXES) else t).contiguous()
        for name, t in state.items()
    }
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        umask = os.umask(0o022)
        os.umask(umask)
        with contextlib.suppress(OSError):  # (as any new file, not safetensors' 0600; a mount may refuse)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except OSError:
        raise
    except Exception as e:  # the safetensors library's own error type for I/O it could not do
        raise OSError(f"cannot write {path}: {e}") from e
    finally:
        if not tmp.is_dir():
            tmp.unlink(missing_ok=True)
