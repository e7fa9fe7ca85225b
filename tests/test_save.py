"""checkpoints.save: files that transformers and our load both read, dtypes, atomic replacement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

import checkpoints
import checkpoints.safetensors_io
from helpers import assert_same_logits, make_model, random_ids, save_hf
from model import GPT, GPTConfig

CONFIGS = {
    "2x2x32": GPTConfig(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2),
    "3x3x48-inner-relu": GPTConfig(vocab_size=517, n_positions=16, n_embd=48, n_layer=3, n_head=3, n_inner=20,
                                   activation_function="relu", layer_norm_epsilon=1e-3),
}  # fmt: skip
SMALL = CONFIGS["2x2x32"]


def our_model(config: GPTConfig = SMALL, seed: int = 0) -> GPT:
    """A random model with every parameter (LayerNorms and biases too) moved off its init."""
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_reads_what_we_save(tmp_path, name):
    config = CONFIGS[name]
    model = our_model(config)
    assert checkpoints.save(model, tmp_path / "ck") == tmp_path / "ck"
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ck").eval()
    assert hf.dtype == torch.float32
    assert_same_logits(model, hf, random_ids(config.vocab_size, 2, config.n_positions), atol=1e-5)


def test_round_trip_through_our_save_is_exact(tmp_path):
    save_hf(tmp_path / "hf", seed=4, **{k: getattr(SMALL, k) for k in ("vocab_size", "n_positions", "n_embd",
                                                                       "n_layer", "n_head")})  # fmt: skip
    first = checkpoints.load(tmp_path / "hf")
    checkpoints.save(first, tmp_path / "ours")
    second = checkpoints.load(tmp_path / "ours")
    assert second.config == first.config
    ours, theirs = dict(second.named_parameters()), dict(first.named_parameters())
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    # The file itself is the Hugging Face layout, tensor for tensor.
    hf_file, our_file = (
        load_file(tmp_path / "hf/model.safetensors"),
        load_file(tmp_path / "ours/model.safetensors"),
    )
    assert our_file.keys() == hf_file.keys()
    for key in hf_file:
        assert torch.equal(our_file[key], hf_file[key]), key


def stored(path) -> tuple[dict[str, str], dict[str, str]]:
    """({file_key: safetensors dtype code}, metadata) of a file, read without loading the tensors."""
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}, f.metadata()  # noqa: SIM118


def test_save_as_float16(tmp_path):
    model = our_model()
    checkpoints.save(model, tmp_path, dtype="float16")
    dtypes, metadata = stored(tmp_path / "model.safetensors")
    assert set(dtypes.values()) == {"F16"} and len(dtypes) == len(list(model.parameters()))
    assert metadata == {"format": "pt"}  # transformers refuses safetensors files without it
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "gpt2" and raw["dtype"] == "float16"
    assert raw["architectures"] == ["GPT2LMHeadModel"] and raw["tie_word_embeddings"] is True
    sizes = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function")
    assert {k: raw[k] for k in sizes} == {k: getattr(SMALL, k) for k in sizes}
    hf_config = transformers.GPT2Config.from_pretrained(tmp_path)
    assert (hf_config.n_embd, hf_config.n_layer, hf_config.n_head) == (32, 2, 2)
    loaded = checkpoints.load(tmp_path)
    assert loaded.wte.weight.dtype == torch.float32
    assert torch.equal(loaded.wte.weight, model.wte.weight.half().float())


def test_default_dtype_is_the_models_own(tmp_path):
    checkpoints.save(our_model().to(torch.bfloat16), tmp_path)
    assert set(stored(tmp_path / "model.safetensors")[0].values()) == {"BF16"}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize(("model_dtype", "dtype", "shown"), [
    (torch.float32, "int8", "'int8'"), (torch.float32, torch.float64, "torch.float64"),
    (torch.float64, None, "torch.float64"),
])  # fmt: skip
def test_unsupported_dtype(tmp_path, model_dtype, dtype, shown):
    with pytest.raises(ValueError, match=f"unsupported dtype {shown}"):
        checkpoints.save(our_model().to(model_dtype), tmp_path / "ck", dtype=dtype)
    assert not (tmp_path / "ck").exists()  # refused before anything is written


@pytest.mark.parametrize("mode", ["int8", "int8-body", "int4", "int4-body"])
def test_a_quantized_model_is_refused_and_nothing_is_written(tmp_path, mode):
    source = checkpoints.save(make_model(CONFIGS["2x2x32"]), tmp_path / "source")
    quantized = checkpoints.load(source, dtype=mode)
    kind = mode[:4]
    expected = rf"{kind}-quantized .*dtype='{kind}' or '{kind}-body'.*float32 or bfloat16"
    with pytest.raises(ValueError, match=expected):
        checkpoints.save(quantized, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_no_temporary_files_are_left(tmp_path):
    checkpoints.save(our_model(), tmp_path / "a" / "b")  # parents are created
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["config.json", "model.safetensors"]


def test_saving_over_a_checkpoint_replaces_it(tmp_path):
    checkpoints.save(our_model(CONFIGS["3x3x48-inner-relu"], seed=1), tmp_path)
    new = our_model(SMALL, seed=2)
    checkpoints.save(new, tmp_path)
    loaded = checkpoints.load(tmp_path)
    assert loaded.config == SMALL
    for name, p in loaded.named_parameters():
        assert torch.equal(p, dict(new.named_parameters())[name]), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_failed_write_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    old = our_model(seed=1)
    checkpoints.save(old, tmp_path)

    def disk_full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoints.safetensors_io, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoints.save(our_model(seed=2), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(checkpoints.load(tmp_path).wte.weight, old.wte.weight)


@pytest.mark.parametrize("blocked", ["config.json", "model.safetensors"])
def test_a_folder_in_place_of_a_file_fails_before_either_file_is_replaced(tmp_path, blocked):
    checkpoints.save(our_model(seed=1), tmp_path)
    kept = {name: (tmp_path / name).read_bytes() for name in ("config.json", "model.safetensors")}
    (tmp_path / blocked).unlink()
    (tmp_path / blocked).mkdir()
    with pytest.raises(IsADirectoryError, match=f"{blocked} is a directory; remove it, or save elsewhere"):
        checkpoints.save(our_model(CONFIGS["3x3x48-inner-relu"], seed=2), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # no temporary
    other = "model.safetensors" if blocked == "config.json" else "config.json"
    assert (tmp_path / other).read_bytes() == kept[other]  # (the new weights beside the old config before)


def test_a_config_that_cannot_be_written_leaves_the_old_pair_and_no_temporary(tmp_path, monkeypatch):
    old = our_model(seed=1)
    checkpoints.save(old, tmp_path)

    def disk_full(self, *args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        checkpoints.save(our_model(seed=2), tmp_path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(checkpoints.load(tmp_path).wte.weight, old.wte.weight)


def test_saving_over_a_sharded_checkpoint_replaces_it(tmp_path):
    hf = save_hf(tmp_path / "tmp", n_layer=2, n_head=2, n_embd=32, vocab_size=300, n_positions=32)
    hf.save_pretrained(tmp_path / "ck", max_shard_size="20KB")
    new = our_model(seed=5)
    assert (tmp_path / "ck" / "model.safetensors.index.json").exists()
    checkpoints.save(new, tmp_path / "ck")
    assert torch.equal(checkpoints.load(tmp_path / "ck").wte.weight, new.wte.weight)
    assert not [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("model-")]


@pytest.mark.parametrize("directory", ["", " "])
def test_an_empty_directory_is_refused_and_nothing_is_written(monkeypatch, tmp_path, directory):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"the directory to save into is empty; give a directory path"):
        checkpoints.save(our_model(), directory)
    assert list(tmp_path.iterdir()) == []


def test_a_write_the_safetensors_library_cannot_do_is_an_oserror(tmp_path):
    # The library raises its own error type for I/O (a read-only directory, here a directory in the way of
    # its temporary file): save() reports it as the OSError its docstring promises.
    import os

    target = tmp_path / "ck"
    target.mkdir()
    (target / f".model.safetensors.tmp-{os.getpid()}").mkdir()
    with pytest.raises(OSError, match=r"cannot write .*model\.safetensors"):
        checkpoints.save(our_model(), target)
    assert not (target / "model.safetensors").exists()


def test_a_saved_checkpoints_files_are_readable_as_any_file_the_user_writes(tmp_path):
    # safetensors writes its file 0600; a saved checkpoint is shared like its config.json (the umask's mode).
    import stat

    from checkpoints.load import SINGLE_FILE

    checkpoints.save(make_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32)), tmp_path)
    config, weights = (stat.S_IMODE((tmp_path / n).stat().st_mode) for n in ("config.json", SINGLE_FILE))
    assert weights == config, (oct(weights), oct(config))
