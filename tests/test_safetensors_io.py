"""checkpoints.safetensors_io: header validation, key mapping and tensor reading (via load where seen)."""

from __future__ import annotations

import inspect
import json
import random
import struct

import pytest
import torch

import checkpoints
from checkpoints import CheckpointError
from checkpoints.safetensors_io import file_shape, iter_tensors, model_key
from helpers import tiny_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    return tiny_checkpoint(tmp_path / "ckpt")


def header_bytes(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    ("content", "match"),
    [(b"", "is 0 bytes, too short to be a safetensors file"),
     (b"abc", "is 3 bytes, too short"),
     (random.Random(0).randbytes(1000), "not a complete safetensors file: its header claims"),
     (struct.pack("<Q", 10**6) + b"{}", "header claims 1000000 bytes but the file has only 2"),
     (struct.pack("<Q", 9) + b"{not json", "is not a safetensors file: its header is not valid JSON"),
     (header_bytes([1, 2]), "its header is not a JSON object"),
     (header_bytes({"wte.weight": "x"}), "header entry 'wte.weight' needs a dtype string"),
     (header_bytes({"wte.weight": {"dtype": "F32", "shape": [1], "data_offsets": [4]}}),
      "two integer data_offsets"),
     (header_bytes({"wte.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}),
      "is truncated: its tensors need")],
)  # fmt: skip
def test_not_safetensors(ckpt, content, match):
    (ckpt[0] / "model.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        checkpoints.load(ckpt[0])


def test_truncated_file(ckpt):
    path = ckpt[0] / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated: its tensors need"):
        checkpoints.load(ckpt[0])


def test_header_inconsistent_with_data(ckpt):
    """A header that passes our size checks but that safetensors rejects (F32 bytes declared F16)."""
    path = ckpt[0] / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].replace(b'"F32"', b'"F16"', 1)  # same length, so offsets stay valid
    path.write_bytes(raw[:8] + header + raw[8 + n :])
    with pytest.raises(
        CheckpointError,
        match=r"cannot read .*model\.safetensors as safetensors: tensor \S+ spans \d+ bytes but F16",
    ):
        checkpoints.load(ckpt[0])


def test_a_shape_its_bytes_cannot_hold_is_refused_before_the_model_is_allocated(ckpt):
    # A 125 KB file claiming 20 billion embedding rows (2.5 TB, matching its config): refused from the header,
    # not after allocating (then an allocator's error) or zero-filling the model.
    path = ckpt[0] / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["transformer.wte.weight"]["shape"] = [20_000_000_000, 32]
    path.write_bytes(header_bytes(header) + raw[8 + n :])
    config = json.loads((ckpt[0] / "config.json").read_text())
    (ckpt[0] / "config.json").write_text(json.dumps({**config, "vocab_size": 20_000_000_000}))
    wanted = r"as safetensors: tensor transformer\.wte\.weight spans 6400 bytes but F32 \[20000000000, 32\]"
    with pytest.raises(CheckpointError, match=wanted + " needs 2560000000000"):
        checkpoints.load(ckpt[0])


@pytest.mark.parametrize(
    "entry",
    [{"dtype": ["F32"], "shape": [50, 32]}, {"dtype": "F32", "shape": 5},
     {"dtype": "F32", "shape": [50, -32]}, {"dtype": "F32", "shape": [50, 32.0]}],
)  # fmt: skip
def test_header_entry_of_wrong_type(ckpt, entry):
    (ckpt[0] / "model.safetensors").write_bytes(
        header_bytes({"transformer.wte.weight": {**entry, "data_offsets": [0, 6400]}}) + bytes(6400)
    )
    with pytest.raises(
        CheckpointError, match=r"header entry 'transformer\.wte\.weight' needs a dtype string"
    ):
        checkpoints.load(ckpt[0])


def test_iter_tensors_is_lazy_and_transposes_conv1d(ckpt):
    directory, model = ckpt
    names = {
        "transformer.h.0.attn.c_attn.weight": "h.0.attn.c_attn.weight",
        "transformer.wte.weight": "wte.weight",
    }
    it = iter_tensors(directory / "model.safetensors", names)
    assert inspect.isgenerator(it)
    name, index, piece = next(it)  # one tensor at a time, in the order asked for
    assert name == "h.0.attn.c_attn.weight" and index == (slice(None), slice(0, piece.shape[1]))
    assert torch.equal(piece, model.h[0].attn.c_attn.weight)  # stored (in, out), handed back (out, in)
    assert [n for n, _, _ in it] == ["wte.weight"]


def test_large_tensors_are_read_in_pieces_that_fill_every_row(ckpt, monkeypatch):
    directory, model = ckpt  # width 32: a wte row is 128 bytes, a stored c_fc row (in, out) 512 bytes
    monkeypatch.setattr("checkpoints.safetensors_io.CHUNK_BYTES", 3 * 128)
    expected = dict(model.named_parameters())
    cases = [("transformer.wte.weight", "wte.weight", 17), ("transformer.h.0.mlp.c_fc.weight",
             "h.0.mlp.c_fc.weight", 32), ("transformer.h.0.ln_1.bias", "h.0.ln_1.bias", 1)]  # fmt: skip
    for file_key, name, count in cases:  # 50 rows by 3; 32 rows by 1 (a row never splits); 32 floats
        target = torch.full_like(expected[name], float("nan"))
        pieces = list(iter_tensors(directory / "model.safetensors", {file_key: name}))
        for _, index, piece in pieces:
            target[index].copy_(piece)
        assert len(pieces) == count and torch.equal(target, expected[name]), name
    assert torch.equal(checkpoints.load(directory).wte.weight, model.wte.weight)  # loading uses the pieces


@pytest.mark.parametrize(
    ("file_key", "expected"),
    [("transformer.wte.weight", "wte.weight"), ("h.1.mlp.c_fc.bias", "h.1.mlp.c_fc.bias"),
     ("transformer.h.0.attn.bias", None), ("h.3.attn.masked_bias", None), ("lm_head.weight", None)],
)  # fmt: skip
def test_model_key(file_key, expected):
    assert model_key(file_key) == expected


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [("h.0.attn.c_attn.weight", (96, 32), (32, 96)), ("h.2.mlp.c_proj.weight", (32, 128), (128, 32)),
     ("h.0.attn.c_attn.bias", (96,), (96,)), ("wte.weight", (50, 32), (50, 32))],
)  # fmt: skip
def test_file_shape_transposes_only_conv1d_weights(name, shape, expected):
    assert file_shape(name, shape) == expected


def _rewrite_header(path, change) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    path.write_bytes(header_bytes(header) + raw[8 + n :])


@pytest.mark.parametrize("flaw", ["overlap", "gap"])
def test_overlapping_or_gapped_byte_ranges_are_refused_as_the_safetensors_library_refuses_them(ckpt, flaw):
    from safetensors import safe_open

    path = ckpt[0] / "model.safetensors"

    def change(header):
        weight, bias = header["transformer.h.0.ln_1.weight"], header["transformer.h.0.ln_1.bias"]
        if flaw == "overlap":  # the bias reads the weight's bytes: both parameters would share them
            bias["data_offsets"] = list(weight["data_offsets"])
        else:  # the same size, moved one element on: a gap before it, an overlap after
            bias["data_offsets"] = [b + 4 for b in bias["data_offsets"]]

    _rewrite_header(path, change)
    # (the library's own error types vary between versions)
    with pytest.raises(Exception), safe_open(path, "pt") as f:  # noqa: B017
        f.get_tensor("transformer.h.0.ln_1.bias")
    with pytest.raises(
        CheckpointError, match=r"not a valid safetensors file: tensor .* occupies bytes \d+\.\.\d+"
    ):
        checkpoints.load(ckpt[0])


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(ckpt, name):
    import os
    import signal

    path = ckpt[0] / name
    path.unlink()
    os.mkfifo(path)

    def hung(signum, frame):
        raise TimeoutError("loading blocked on the FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)  # opening a FIFO for reading blocks until a writer comes: a regression fails here
    try:
        with pytest.raises(CheckpointError, match=rf"{name} is a FIFO, socket or device, not a regular file"):
            checkpoints.load(ckpt[0])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_huge_config_json_is_refused_unread(ckpt):
    (ckpt[0] / "config.json").write_bytes(b" " * (2**20 + 1))
    with pytest.raises(CheckpointError, match=r"config\.json holds more than 1,048,576 bytes"):
        checkpoints.load(ckpt[0])
