"""Fuzzing the loader: random and mutated safetensors bytes and random config.json contents.

Every outcome is a loaded model or a :class:`CheckpointError` (a ``ValueError``), within a time and memory
bound: never another exception type, a hang, or memory growing with an absurd header or config.
"""

from __future__ import annotations

import json
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checkpoints
from checkpoints import CheckpointError
from helpers import tiny_checkpoint

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
SECONDS = 5.0  # per load: the tiny checkpoint loads in milliseconds
RSS_GROWTH = 200 * 2**20  # a load that allocated what an absurd header or config asks would pass this


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> dict[str, bytes]:
    """The tiny checkpoint's two files, written once; each example gets its own copy to spoil."""
    directory, _ = tiny_checkpoint(tmp_path_factory.mktemp("fuzz") / "original")
    return {name: (directory / name).read_bytes() for name in ("config.json", "model.safetensors")}


def _copy(tmp_path_factory, original: dict[str, bytes]):
    directory = tmp_path_factory.mktemp("fuzz")
    for name, data in original.items():
        (directory / name).write_bytes(data)
    return directory


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _outcome(directory) -> str:
    """Load, returning "loaded" or "refused"; anything else fails the test (its exception propagates)."""
    before, start = _rss(), time.perf_counter()
    try:
        checkpoints.load(directory)
        outcome = "loaded"
    except CheckpointError:
        outcome = "refused"
    assert time.perf_counter() - start < SECONDS
    assert _rss() - before < RSS_GROWTH
    return outcome


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
)


@st.composite
def headers(draw) -> dict:
    """Safetensors headers with plausible and implausible entries (names, dtypes, shapes, offsets)."""
    names = st.sampled_from(
        ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight", "lm_head.weight",
         "transformer.h.99.attn.c_attn.weight", "__metadata__", "x"]
    )  # fmt: skip
    entry = st.fixed_dictionaries(
        {},
        optional={
            "dtype": st.one_of(st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "??"]), _VALUES),
            "shape": st.one_of(st.lists(st.integers(-1, 2**40), max_size=4), _VALUES),
            "data_offsets": st.one_of(st.lists(st.integers(-1, 2**40), min_size=2, max_size=2), _VALUES),
        },
    )
    return draw(st.dictionaries(names, st.one_of(entry, _VALUES), max_size=5))


@SETTINGS
@given(
    header=headers(), data=st.binary(max_size=256), claimed=st.one_of(st.none(), st.integers(0, 2**64 - 1))
)
def test_random_headers_load_or_are_refused(tmp_path_factory, original, header, data, claimed):
    directory = _copy(tmp_path_factory, original)
    raw = json.dumps(header).encode()
    length = len(raw) if claimed is None else claimed
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", length) + raw + data)
    assert _outcome(directory) == "refused"  # none of these holds the tiny model's weights


@SETTINGS
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.one_of(st.none(), st.integers(0, 10**6)))  # fmt: skip
def test_mutated_real_files_load_or_are_refused(tmp_path_factory, original, flips, cut):
    directory = _copy(tmp_path_factory, original)
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    for position, value in flips:  # mostly into the header, where the parser is
        data[position % (8 + header_len + 64)] = value
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    path.write_bytes(bytes(data))
    _outcome(directory)


FIELDS = ["n_layer", "n_head", "n_embd", "n_positions", "vocab_size", "n_inner", "layer_norm_epsilon",
          "activation_function", "resid_pdrop", "model_type", "architectures", "n_ctx"]  # fmt: skip


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from(FIELDS), _VALUES, min_size=1, max_size=4))
def test_random_config_values_load_or_are_refused(tmp_path_factory, original, changes):
    directory = _copy(tmp_path_factory, original)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    _outcome(directory)


@SETTINGS
@given(text=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_random_config_bytes_load_or_are_refused(tmp_path_factory, original, text):
    directory = _copy(tmp_path_factory, original)
    (directory / "config.json").write_bytes(text)
    assert _outcome(directory) == "refused"
