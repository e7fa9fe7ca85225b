"""checkpoints.hf_config: GPT-2 config.json <-> GPTConfig, legacy names, refusals."""

from __future__ import annotations

import json

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoints import CheckpointError
from checkpoints.hf_config import config_from_dict, config_to_dict, read_config
from model import GPTConfig
from model.config import ACTIVATIONS

SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "layer_norm_epsilon",
         "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop")  # fmt: skip


def test_missing_fields_take_gpt2_defaults():
    assert config_from_dict({}) == GPTConfig()
    assert config_from_dict({"n_layer": 3}) == GPTConfig(n_layer=3)


def test_legacy_n_ctx():
    assert config_from_dict({"n_ctx": 64}).n_positions == 64
    assert config_from_dict({"n_ctx": 64, "n_positions": 128}).n_positions == 128  # the modern name wins


def test_extra_fields_are_ignored():
    raw = {"n_embd": 64, "n_head": 4, "architectures": ["GPT2LMHeadModel"], "bos_token_id": 50256,
           "summary_type": "cls_index", "transformers_version": "4.0", "use_cache": True,
           "dtype": "float16", "initializer_range": 0.02, "reorder_and_upcast_attn": False,
           "scale_attn_weights": True}  # fmt: skip
    assert config_from_dict(raw) == GPTConfig(n_embd=64, n_head=4)


def test_reads_transformers_own_config_dict():
    hf = transformers.GPT2Config(n_embd=48, n_head=3, n_layer=5, n_positions=16, vocab_size=517, n_inner=20)
    assert config_from_dict(hf.to_dict()) == GPTConfig(
        n_embd=48, n_head=3, n_layer=5, n_positions=16, vocab_size=517, n_inner=20
    )


def test_transformers_other_names_for_four_fields_are_read_as_it_reads_them():
    raw = {"hidden_size": 48, "num_attention_heads": 8, "num_hidden_layers": 3, "max_position_embeddings": 16}
    hf = transformers.GPT2Config.from_dict(raw)
    want = GPTConfig(n_embd=48, n_head=8, n_layer=3, n_positions=16)
    assert (hf.n_embd, hf.n_head, hf.n_layer, hf.n_positions) == (48, 8, 3, 16)
    assert config_from_dict(raw) == want  # (the head count was silently 12: no weight's shape shows it)
    assert config_from_dict({**raw, "n_head": 8}) == want
    assert config_from_dict({**raw, "n_ctx": 1024}) == want  # (the legacy name only where no other is)
    with pytest.raises(CheckpointError, match=r"cfg: n_head=4 but num_attention_heads=8, which names the "
                       r"same setting; keep one of them"):  # fmt: skip
        config_from_dict({**raw, "n_head": 4}, source="cfg")


@pytest.mark.parametrize(
    "config",
    [GPTConfig(), GPTConfig(vocab_size=300, n_positions=16, n_embd=48, n_layer=5, n_head=3),
     GPTConfig(n_embd=32, n_head=2, n_layer=1, n_inner=40, activation_function="relu",
               layer_norm_epsilon=1e-3, resid_pdrop=0.0, embd_pdrop=0.25, attn_pdrop=0.5)],
)  # fmt: skip
def test_round_trip(config):
    out = config_to_dict(config, dtype="bfloat16")
    assert config_from_dict(json.loads(json.dumps(out))) == config
    assert out["model_type"] == "gpt2" and out["architectures"] == ["GPT2LMHeadModel"]
    assert out["tie_word_embeddings"] is True and out["dtype"] == "bfloat16"
    # transformers reads the same values from it
    hf = transformers.GPT2Config(**out)
    assert {k: getattr(hf, k) for k in SIZES} == {k: getattr(config, k) for k in SIZES}


@settings(max_examples=40, deadline=None)
@given(
    head_dim=st.integers(1, 16), n_head=st.integers(1, 8), n_layer=st.integers(1, 48),
    vocab_size=st.integers(1, 100_000), n_positions=st.integers(1, 4096),
    n_inner=st.none() | st.integers(1, 4096), activation=st.sampled_from(ACTIVATIONS),
    eps=st.floats(1e-12, 1e-1), pdrop=st.floats(0.0, 0.99),
)  # fmt: skip
def test_round_trip_any_valid_config(head_dim, n_head, n_layer, vocab_size, n_positions, n_inner, activation,
                                     eps, pdrop):  # fmt: skip
    config = GPTConfig(vocab_size=vocab_size, n_positions=n_positions, n_embd=head_dim * n_head,
                       n_layer=n_layer, n_head=n_head, n_inner=n_inner, layer_norm_epsilon=eps,
                       activation_function=activation, attn_pdrop=pdrop)  # fmt: skip
    assert config_from_dict(json.loads(json.dumps(config_to_dict(config, dtype="float32")))) == config


def test_token_ids_only_for_gpt2_vocabulary():
    assert config_to_dict(GPTConfig(), dtype="float32")["eos_token_id"] == 50256
    small = config_to_dict(GPTConfig(vocab_size=300), dtype="float32")
    assert "bos_token_id" not in small and "eos_token_id" not in small  # 50256 would be out of range


@pytest.mark.parametrize(
    ("key", "value"),
    [("scale_attn_weights", False), ("scale_attn_by_inverse_layer_idx", True), ("add_cross_attention", True),
     ("tie_word_embeddings", False)],
)  # fmt: skip
def test_unsupported_options(key, value):
    with pytest.raises(CheckpointError, match=f"my/config.json: {key}={value!r} is not supported"):
        config_from_dict({key: value}, source="my/config.json")


@pytest.mark.parametrize(
    ("raw", "match"),
    [({"model_type": "llama"}, "model_type is 'llama'; only 'gpt2'"),
     ({"n_embd": 30, "n_head": 4}, r"n_embd \(30\) must be divisible by n_head \(4\)"),
     ({"n_layer": 0}, "n_layer must be a positive integer, got 0"),
     ({"n_embd": 32.0, "n_head": 2}, "n_embd must be a positive integer, got 32.0"),
     ({"n_inner": True}, "n_inner must be a positive integer or None"),
     ({"activation_function": "gelu_10"}, "activation_function 'gelu_10' is not supported"),
     ({"attn_pdrop": 1.0}, r"attn_pdrop must be in \[0, 1\), got 1.0")],
)  # fmt: skip
def test_impossible_values(raw, match):
    with pytest.raises(CheckpointError, match=f"^cfg.json: .*{match}"):
        config_from_dict(raw, source="cfg.json")


def test_read_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_to_dict(GPTConfig(n_layer=2), dtype="float32")))
    assert read_config(path) == GPTConfig(n_layer=2)


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "config.json does not exist; a checkpoint directory needs a config.json"),
     (b'{"n_layer": 2', r"config.json is not valid JSON \(line 1, column 14"),
     (b'"gpt2"', "must hold a JSON object, found str"),
     (b'{"n_layer": "\xff"}', "cannot read .*config.json"),
     (b'{"n_layer": -2}', r"config.json: GPTConfig.n_layer must be a positive integer, got -2")],
)  # fmt: skip
def test_read_config_errors(tmp_path, content, match):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match=match):
        read_config(path)
