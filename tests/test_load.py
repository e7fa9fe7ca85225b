"""checkpoints.load: parity with transformers, file layouts, dtypes, hub ids, and every refusal."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import checkpoints
from checkpoints import CheckpointError, safetensors_io
from helpers import assert_same_logits, random_ids, save_hf, tiny_checkpoint
from model import GPTConfig

PARITY_CONFIGS = {
    "2x2x32": dict(n_layer=2, n_head=2, n_embd=32, vocab_size=300, n_positions=32),
    "5x3x48-short": dict(n_layer=5, n_head=3, n_embd=48, vocab_size=517, n_positions=16),
    "n_inner": dict(n_layer=2, n_head=4, n_embd=32, n_inner=40, vocab_size=401, n_positions=24),
    "gelu-eps": dict(n_layer=1, n_head=1, n_embd=24, activation_function="gelu", layer_norm_epsilon=1e-3,
                     vocab_size=1000, n_positions=20),
    "relu": dict(n_layer=3, n_head=2, n_embd=16, n_inner=8, activation_function="relu", vocab_size=333,
                 n_positions=12),
}  # fmt: skip
SMALL = PARITY_CONFIGS["2x2x32"]


def our_config(hf: dict) -> GPTConfig:
    return GPTConfig(**hf)


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    kw = PARITY_CONFIGS[name]
    hf = save_hf(tmp_path, seed=1, **kw)
    ours = checkpoints.load(tmp_path)
    assert ours.config == our_config(kw)
    assert_same_logits(ours, hf, random_ids(kw["vocab_size"], 3, kw["n_positions"]), atol=1e-4)
    assert_same_logits(ours, hf, random_ids(kw["vocab_size"], 2, 5, seed=1), atol=1e-4)


def legacy_file(tmp_path):
    """A prefix-less file without lm_head but with the old causal-mask buffers, and its HF model."""
    hf = save_hf(tmp_path / "hf", **SMALL)
    state = {
        k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "hf/model.safetensors").items()
    }
    state.pop("lm_head.weight", None)
    n = SMALL["n_positions"]
    for i in range(SMALL["n_layer"]):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    (tmp_path / "legacy").mkdir()
    path = tmp_path / "legacy" / "weights.safetensors"
    save_file(state, path)
    return path, hf


def test_prefixless_legacy_file_by_path(tmp_path):
    path, hf = legacy_file(tmp_path)
    shutil.copy(tmp_path / "hf/config.json", path.parent / "config.json")
    assert_same_logits(checkpoints.load(path), hf, random_ids(300, 2, 32), atol=1e-4)


@pytest.mark.parametrize("how", ["GPTConfig", "config.json path"])
def test_prefixless_legacy_file_with_config_argument(tmp_path, how):
    path, hf = legacy_file(tmp_path)  # no config.json beside it
    config = our_config(SMALL) if how == "GPTConfig" else str(tmp_path / "hf/config.json")
    assert_same_logits(checkpoints.load(path, config=config), hf, random_ids(300, 2, 32), atol=1e-4)


def test_sharded_checkpoint(tmp_path):
    hf = save_hf(tmp_path, seed=2, **SMALL)
    shutil.rmtree(tmp_path)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert_same_logits(checkpoints.load(tmp_path), hf, random_ids(300, 2, 32), atol=1e-4)


@pytest.fixture
def ckpt(tmp_path):
    return tiny_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), (torch.float16, torch.float16),
     ("float32", torch.float32), (None, torch.float32)],
)  # fmt: skip
def test_dtype_eval_mode_and_device(ckpt, dtype, expected):
    directory, model = ckpt
    loaded = checkpoints.load(directory, dtype=dtype)
    assert not loaded.training
    for name, p in loaded.named_parameters():
        assert p.dtype == expected and p.device.type == "cpu"
        assert torch.equal(p, dict(model.named_parameters())[name].to(expected))  # cast, not re-initialised
    assert loaded(torch.tensor([[1, 2, 3]])).dtype == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_fp32_head_is_multiplied_over_a_width_padded_to_16(ckpt, dtype):
    directory, model = ckpt  # vocab 50: padded to 64 in fp32; bf16 and fp16 keep (vocab, n_embd)
    head = checkpoints.load(directory, dtype=dtype).wte
    weight, x = head.weight, torch.randn(3, 5, 32).to(head.weight.dtype)
    assert torch.equal(weight, model.wte.weight.to(weight.dtype))
    if dtype == "float32":
        assert weight.stride() == (1, 64)
        stored = weight.as_strided((64, 32), (1, 64))  # the matrix the product reads
        assert torch.equal(stored[50:], torch.zeros(14, 32))
        assert torch.equal(head.project(x), F.linear(x, stored)[..., :50])
    else:
        assert weight.is_contiguous()
    assert head.project(x).shape == (3, 5, 50)
    torch.testing.assert_close(head.project(x), F.linear(x, model.wte.weight.to(x.dtype)), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("dtype", "shown"),
    [("int2", "'int2'"), ("float64", "'float64'"), (torch.int32, "torch.int32"), (torch.int8, "torch.int8")],
)
def test_bad_dtype(ckpt, dtype, shown):
    with pytest.raises(
        ValueError,
        match=f"unsupported dtype .*{shown}.*, or the names 'int8', 'int8-body', 'int4', 'int4-body'",
    ):
        checkpoints.load(ckpt[0], dtype=dtype)


def test_int8_weight_only(ckpt):
    """dtype="int8" (a name only, not torch.int8) loads fp32 weights and quantizes them."""
    directory, model = ckpt
    int8 = checkpoints.load(directory, dtype="int8")
    assert not int8.training
    ids = random_ids(50, 2, 8)
    with torch.no_grad():
        a, b = model(ids), int8(ids).float()
    assert ((a - b).abs().mean() / a.abs().mean()).item() < 0.05


def test_bad_device(ckpt):
    with pytest.raises(ValueError, match="unknown device 'gpu0'; use 'cpu'"):
        checkpoints.load(ckpt[0], device="gpu0")
    with pytest.raises(ValueError, match=r"device 'meta' is not supported .*; use 'cpu'"):
        checkpoints.load(ckpt[0], device="meta")  # a real torch device, but it holds no data to generate from
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:0' is not available"):
            checkpoints.load(ckpt[0], device="cuda:0")
    else:
        count = torch.cuda.device_count()
        with pytest.raises(ValueError, match=f"has {count} CUDA device"):
            checkpoints.load(ckpt[0], device=f"cuda:{count}")


def test_a_device_that_cannot_run_the_model_is_refused_in_one_line(ckpt, monkeypatch):
    real = torch.softmax

    def broken(x, *args, **kwargs):
        raise RuntimeError("backend failure\nwith a long\nmulti-line report")

    monkeypatch.setattr(torch, "softmax", broken)
    with pytest.raises(ValueError) as info:
        checkpoints.load(ckpt[0], device="cpu")
    monkeypatch.setattr(torch, "softmax", real)
    assert (
        str(info.value)
        == "device 'cpu' cannot run the model (backend failure); reinstall torch, whose CPU build runs it"
    )


def write_config(directory, **changes):
    raw = json.loads((directory / "config.json").read_text())
    raw.update(changes)
    (directory / "config.json").write_text(json.dumps(raw))


def rewrite_weights(directory, edit):
    """Apply ``edit`` to the checkpoint's {file_key: tensor} and write it back."""
    state = load_file(directory / "model.safetensors")
    edit(state)
    save_file(state, directory / "model.safetensors")


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint path .*nope does not exist"):
        checkpoints.load(tmp_path / "nope")


def test_directory_layout_errors(ckpt):
    directory = ckpt[0]
    shutil.copy(directory / "model.safetensors", directory / "model-00001-of-00001.safetensors")
    (directory / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(
        CheckpointError, match=r"holds both model\.safetensors and model\.safetensors\.index\.json"
    ):
        checkpoints.load(directory)
    for name in ("model.safetensors", "model.safetensors.index.json", "model-00001-of-00001.safetensors"):
        (directory / name).unlink()
    assert [p.name for p in directory.iterdir()] == ["config.json"]
    with pytest.raises(
        CheckpointError, match=r"has no model\.safetensors or model\.safetensors\.index\.json$"
    ):
        checkpoints.load(directory)
    (directory / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin is pickle, which gptgen never loads"):
        checkpoints.load(directory)


@pytest.mark.parametrize(
    ("changes", "match"),
    [({"n_embd": 30, "n_head": 4}, r"n_embd \(30\) must be divisible by n_head \(4\)"),
     ({"n_layer": -1}, "n_layer must be a positive integer, got -1"),
     ({"model_type": "llama"}, "model_type is 'llama'; only 'gpt2'"),
     ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not supported")],
)  # fmt: skip
def test_impossible_or_unsupported_config(ckpt, changes, match):
    write_config(ckpt[0], **changes)
    with pytest.raises(CheckpointError, match=match):
        checkpoints.load(ckpt[0])


def test_config_not_json_or_not_object(ckpt):
    (ckpt[0] / "config.json").write_text('{"n_embd": 32,')
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON \(line 1"):
        checkpoints.load(ckpt[0])
    (ckpt[0] / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="must hold a JSON object, found list"):
        checkpoints.load(ckpt[0])


def test_missing_and_unexpected_keys(ckpt):
    rewrite_weights(ckpt[0], lambda s: s.pop("transformer.ln_f.bias"))
    with pytest.raises(CheckpointError, match=r"missing keys \['ln_f.bias'\] \(1 in all\)"):
        checkpoints.load(ckpt[0])
    rewrite_weights(ckpt[0], lambda s: s.update({"transformer.ln_f.bias": torch.zeros(32)}))
    rewrite_weights(ckpt[0], lambda s: s.update({"transformer.h.7.mlp.c_fc.bias": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected keys \['transformer.h.7.mlp.c_fc.bias'\]"):
        checkpoints.load(ckpt[0])


def test_duplicate_keys_are_refused(ckpt):
    rewrite_weights(
        ckpt[0], lambda s: s.update({"wte.weight": torch.zeros(50, 32)})
    )  # with and without prefix
    with pytest.raises(
        CheckpointError, match=r"tensor (transformer\.)?wte\.weight is wte\.weight, which the "
    ):
        checkpoints.load(ckpt[0])


def test_relative_path_under_an_existing_directory_is_a_missing_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(CheckpointError, match="checkpoint path runs/my-model does not exist"):
        checkpoints.load("runs/my-model")


def test_shape_mismatch(ckpt):
    write_config(ckpt[0], vocab_size=60)
    with pytest.raises(
        CheckpointError, match=r"transformer\.wte\.weight has shape \(50, 32\) .* implies \(60, 32\)"
    ):
        checkpoints.load(ckpt[0])
    write_config(ckpt[0], vocab_size=50, n_embd=64)
    with pytest.raises(
        CheckpointError, match=r"tensor transformer\.\S+ has shape \(.*\) but the config implies"
    ):
        checkpoints.load(ckpt[0])


def test_a_stored_output_head_is_accepted_when_it_fits_and_refused_when_not(ckpt):
    # Older files store lm_head.weight (a copy of the tied wte): it is not read, but its shape is checked.
    rewrite_weights(ckpt[0], lambda s: s.update({"lm_head.weight": s["transformer.wte.weight"].clone()}))
    assert torch.equal(checkpoints.load(ckpt[0]).wte.weight, ckpt[1].wte.weight)
    rewrite_weights(ckpt[0], lambda s: s.update({"lm_head.weight": torch.zeros(7, 3)}))
    with pytest.raises(
        CheckpointError,
        match=r"lm_head\.weight has shape \(7, 3\) but the output head is tied to wte, \(50, 32\)",
    ):
        checkpoints.load(ckpt[0])


def test_a_stored_output_head_that_differs_from_the_embedding_is_refused_not_dropped(ckpt, monkeypatch):
    # transformers computes such a file's logits with its lm_head: dropping it would give other logits.
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 32 * 4 * 8)  # pieces of 8 rows: row 37 in the 5th

    def untie(state, dtype=torch.float32):
        state["lm_head.weight"] = state["transformer.wte.weight"].clone().to(dtype)
        state["lm_head.weight"][37, 5] += 1e-7

    rewrite_weights(ckpt[0], untie)
    own_head = r"lm_head\.weight differs from transformer\.wte\.weight: an output head of its own, which this"
    with pytest.raises(CheckpointError, match=own_head + r" loader does not support .* \(from row 32\)"):
        checkpoints.load(ckpt[0])
    rewrite_weights(ckpt[0], lambda s: untie(s, torch.float16))
    with pytest.raises(CheckpointError, match=r"differs from .*; they are even stored in different dtypes"):
        checkpoints.load(ckpt[0])


def test_single_file_with_a_preset_name(ckpt, monkeypatch):
    import model.config

    # The real presets are 82M+ parameters; a tiny entry exercises the same lookup.
    monkeypatch.setitem(model.config.PRESETS, "tiny", ckpt[1].config)
    moved = ckpt[0].parent / "alone.safetensors"
    (ckpt[0] / "model.safetensors").rename(moved)
    loaded = checkpoints.load(moved, config="tiny")
    assert loaded.config == ckpt[1].config
    assert torch.equal(loaded.h[0].attn.c_attn.weight, ckpt[1].h[0].attn.c_attn.weight)


@pytest.mark.parametrize(("dtype", "code"), [(torch.int32, "I32"), (torch.int8, "I8")])
def test_unsupported_tensor_dtype(ckpt, dtype, code):
    rewrite_weights(ckpt[0], lambda s: s.update({"transformer.ln_f.weight": torch.ones(32, dtype=dtype)}))
    with pytest.raises(
        CheckpointError, match=rf"ln_f\.weight has dtype '{code}'; supported weight dtypes are F32"
    ):
        checkpoints.load(ckpt[0])


def test_float64_file_is_read(ckpt):
    rewrite_weights(ckpt[0], lambda s: s.update({k: v.double() for k, v in s.items()}))
    assert torch.equal(checkpoints.load(ckpt[0]).wte.weight, ckpt[1].wte.weight)


@pytest.mark.parametrize(
    ("shard", "match"),
    [("../x.safetensors", r"names shard .*not a \.safetensors file here"),
     ("sub/model.safetensors", r"names shard .*not a \.safetensors file here"),
     ("weights.bin", "names shard 'weights.bin', which is not a .safetensors file here"),
     ("model-00002-of-00002.safetensors", r"names shard 'model-00002-of-00002\.\w+', which is missing")],
)  # fmt: skip
def test_bad_index(ckpt, shard, match):
    directory = ckpt[0]
    (directory / "model.safetensors").rename(directory / "model-00001-of-00002.safetensors")
    (directory.parent / "x.safetensors").write_bytes(b"outside")
    weight_map = {
        "transformer.wte.weight": "model-00001-of-00002.safetensors",
        "transformer.wpe.weight": shard,
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=match):
        checkpoints.load(directory)


@pytest.mark.parametrize(
    ("content", "match"),
    [('{"metadata": {}}', "it must be a JSON object whose weight_map maps tensor names to shard file names"),
     ("[1]", "it must be a JSON object whose weight_map"), ('{"weight_map": [1]}', "whose weight_map maps"),
     ("{", r"\(JSON\): Expecting property name")],
)  # fmt: skip
def test_index_not_a_weight_map(ckpt, content, match):
    (ckpt[0] / "model.safetensors").unlink()
    (ckpt[0] / "model.safetensors.index.json").write_text(content)
    with pytest.raises(CheckpointError, match=r"index\.json is not a valid safetensors index.*" + match):
        checkpoints.load(ckpt[0])


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
@pytest.mark.parametrize("target", ["gone.safetensors", "itself"])
def test_a_weights_file_linking_to_nothing_is_named_as_such(ckpt, name, target):
    link = ckpt[0] / name
    link.unlink(missing_ok=True)
    (ckpt[0] / "model.safetensors").unlink(missing_ok=True)
    link.symlink_to(link.name if target == "itself" else target)
    with pytest.raises(CheckpointError, match=rf"{name} is a link to nothing \(its target is missing"):
        checkpoints.load(ckpt[0])


@pytest.mark.parametrize("weight_map", [{}, {"transformer.wte.weight": 5}, ["model.safetensors"]])
def test_index_with_no_shards_or_a_non_string_shard(ckpt, weight_map):
    (ckpt[0] / "model.safetensors").unlink()
    (ckpt[0] / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="whose weight_map maps tensor names to shard file names"):
        checkpoints.load(ckpt[0])


def test_file_and_config_argument_errors(ckpt, monkeypatch):
    path = ckpt[0] / "model.safetensors"
    moved = ckpt[0].parent / "alone.safetensors"
    path.rename(moved)
    expected = (
        r"has no config\.json beside it; put the model.s config\.json there, or name its config: --config in "
        r"the commands, config= in Python \(a config\.json path, or a preset such as 'gpt2'\)"
    )
    with pytest.raises(CheckpointError, match=expected):
        checkpoints.load(moved)
    with pytest.raises(CheckpointError, match="config='gpt3': unknown preset 'gpt3'"):
        checkpoints.load(moved, config="gpt3")
    # config= may name the checkpoint directory that holds the config.json, or any path to one; an empty
    # value never means the working directory's config.json.
    assert (
        checkpoints.load(moved, config=ckpt[0]).config
        == checkpoints.load(moved, config=ckpt[0] / "config.json").config
    )
    with pytest.raises(CheckpointError, match=r"the config is empty; give a config\.json path"):
        checkpoints.load(moved, config="")
    with pytest.raises(CheckpointError, match=r"nothere/settings does not exist"):
        checkpoints.load(moved, config="nothere/settings")  # a path, not taken for a preset name
    # A preset name is the preset even where the working directory holds a folder of that name.
    (ckpt[0].parent / "distilgpt2").mkdir()
    monkeypatch.chdir(ckpt[0].parent)
    with pytest.raises(CheckpointError, match="the config says n_layer=6 but the weights hold"):
        checkpoints.load(moved, config="distilgpt2")
    (ckpt[0] / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"neither a checkpoint directory nor a \.safetensors file"):
        checkpoints.load(ckpt[0] / "weights.bin")


HUB_ID = "openai-community/gpt2"


def test_hub_offline(monkeypatch, tmp_path):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match=r"LocalEntryNotFoundError.*pass its local directory") as info:
        checkpoints.load(HUB_ID)
    assert isinstance(info.value.__cause__, LocalEntryNotFoundError)


def test_hub_not_installed(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(CheckpointError, match=r"'openai-community/gpt2' .*pip install 'gptgen\[hf\]'"):
        checkpoints.load(HUB_ID)


def test_hub_id_resolves_to_snapshot(monkeypatch, tmp_path):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    hf = save_hf(tmp_path / "snapshot", seed=3, **SMALL)
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append(repo_id)
        return str(tmp_path / "snapshot")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert_same_logits(checkpoints.load(HUB_ID), hf, random_ids(300, 2, 16), atol=1e-4)
    assert calls == [HUB_ID]


def test_config_json_missing_from_a_directory(ckpt):
    (ckpt[0] / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json does not exist; a checkpoint directory needs"):
        checkpoints.load(ckpt[0])


def test_an_unreadable_weights_file(ckpt, monkeypatch):
    # chmod does not stop root (CI may run as root), so the refusal is simulated where the file is opened.
    from pathlib import Path

    real_open = Path.open

    def deny(self, *args, **kwargs):
        if self.name == "model.safetensors":
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", deny)
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors: .*Permission denied"):
        checkpoints.load(ckpt[0])


def test_absurdly_nested_json_is_refused_not_a_recursion_error(ckpt):
    header = b"[" * 200_000
    path = ckpt[0] / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors is not a safetensors file: .*RecursionError"
    ):
        checkpoints.load(ckpt[0])
    (ckpt[0] / "config.json").write_text("[" * 200_000)
    with pytest.raises(CheckpointError, match=r"config\.json nests JSON too deeply"):
        checkpoints.load(ckpt[0])


@pytest.mark.parametrize("dtype", ["float32", "int8", "int8-body"])
def test_loading_builds_on_meta_without_importing_the_compiler(tmp_path, dtype):
    # Initialisers and triu on meta tensors run Python references that import torch._dynamo and sympy
    # (75 MB resident for the rest of the process); loading skips them, as every weight is read anyway.
    # torch.empty_like of a meta tensor (what to_empty calls) imports sympy alone: 36 MiB.
    import subprocess
    from pathlib import Path

    directory, _ = tiny_checkpoint(tmp_path / "ckpt")
    code = (
        "import sys, checkpoints; m = checkpoints.load(sys.argv[1], dtype=sys.argv[2]); "
        "assert 'torch._dynamo' not in sys.modules, 'loading imported torch._dynamo'; "
        "assert 'sympy' not in sys.modules, 'loading imported sympy'; "
        "assert m.h[0].attn.mask.sum() == m.config.n_positions * (m.config.n_positions - 1) // 2"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code, str(directory), dtype], cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_a_shipped_name_means_the_shipped_checkpoint_whatever_the_working_directory_holds(
    monkeypatch, tmp_path
):
    # A folder of the shipped name in the working directory, empty or holding another checkpoint, changes
    # nothing: the name is the shipped model; "./shakespeare" is the folder.
    import generate

    save_hf(tmp_path / "shakespeare", seed=3, **SMALL)
    monkeypatch.chdir(tmp_path)
    shipped = checkpoints.load("shakespeare")
    assert shipped.config.n_embd != SMALL["n_embd"] and shipped.num_parameters() > 10**7
    assert generate.load("shakespeare").model.config == shipped.config
    assert checkpoints.load("./shakespeare").config.n_embd == SMALL["n_embd"]
    assert checkpoints.load(tmp_path / "shakespeare").config.n_embd == SMALL["n_embd"]  # a Path is a path
    (tmp_path / "shakespeare" / "config.json").unlink()  # a broken folder of that name: still the shipped one
    assert checkpoints.load("shakespeare").config == shipped.config


@pytest.mark.parametrize("source", ["", "  "])
def test_an_empty_path_is_an_error_not_the_working_directory(monkeypatch, tmp_path, source):
    save_hf(tmp_path, seed=3, **SMALL)  # a checkpoint right in the working directory
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="the checkpoint path is empty; give a directory"):
        checkpoints.load(source)
    assert checkpoints.load(".").config.n_embd == SMALL["n_embd"]  # "." names it explicitly


@pytest.mark.parametrize(("field", "value"), [("n_layer", 2**70), ("n_layer", 20_000), ("n_positions", 10**6),
                                              ("vocab_size", 10**9), ("n_embd", 2**20)])  # fmt: skip
def test_an_absurd_config_is_refused_from_the_headers_before_anything_is_built(ckpt, field, value):
    # n_layer 2**70 grew memory until killed and 20,000 took 19 s and 900 MB before "missing keys".
    import time

    config = json.loads((ckpt[0] / "config.json").read_text())
    config[field] = value
    if field == "n_embd":
        config["n_head"] = 1
    (ckpt[0] / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"the config\.json does not describe these weights"):
        checkpoints.load(ckpt[0])
    assert time.perf_counter() - start < 2


def test_a_shipped_name_as_a_path_that_is_not_here_is_still_the_shipped_checkpoint(monkeypatch, tmp_path):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    assert checkpoints.load(Path("shakespeare")).config == checkpoints.load("shakespeare").config
