"""The training script: a tiny run writes a loadable checkpoint and card, and resuming is exact."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import checkpoints
from checkpoints import train

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--context", "16", "--batch-size", "2"]
SCHEDULE = ["--steps", "4", "--eval-every", "2", "--eval-windows", "2", "--warmup", "1", "--log-every", "1"]


@pytest.fixture
def work(tmp_path):
    """A work directory holding a small synthetic corpus (no download)."""
    rng = np.random.default_rng(0)
    directory = tmp_path / "work"
    directory.mkdir()
    np.save(directory / "train.npy", rng.integers(0, 500, 400).astype(np.uint16), allow_pickle=False)
    np.save(directory / "val.npy", rng.integers(0, 500, 300).astype(np.uint16), allow_pickle=False)
    (directory / "heldout.txt").write_text("Tomorrow, and tomorrow,\nCreeps in this petty pace\n")
    return directory


def _run(work, out, *extra):
    train.main([*TINY, *SCHEDULE, "--work-dir", str(work), "--out", str(out), *extra])


def test_a_tiny_run_ships_a_checkpoint_and_a_card(work, tmp_path, capsys):
    out = tmp_path / "out"
    _run(work, out)
    log = capsys.readouterr().out
    assert "step 4/4 loss" in log and "tok/s" in log and "held-out loss" in log
    model = checkpoints.load(out)
    assert not model.training and model.config.n_layer == 1
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.float16}
    facts = json.loads((out / "training.json").read_text())
    assert facts["steps"] == 4 and facts["tokens_seen"] == 4 * 2 * 16
    assert facts["command"].startswith("python -m checkpoints.train --n-layer 1")
    card = (out / "README.md").read_text()
    assert f"{facts['held_out_loss']:.4f}" in card and facts["command"] in card


def test_evaluation_leaves_an_inference_model_in_eval_mode(work, tmp_path):
    """The card's slice loss must be computed without dropout (a bug once shipped a dropout-on figure)."""
    out = tmp_path / "out"
    _run(work, out, "--dropout", "0.5")
    facts = json.loads((out / "training.json").read_text())
    ids = torch.tensor(facts["held_out_slice"]["token_ids"])
    model = checkpoints.load(out)
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(ids[None, :-1])[0], ids[1:]).item()
    assert loss == pytest.approx(facts["held_out_slice"]["loss"], abs=1e-5)
    train.heldout_loss(model, np.load(work / "val.npy"), 16, 2, bf16=False)
    assert not model.training


def test_resuming_gives_the_weights_of_an_uninterrupted_run(work, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    _run(work, whole)

    resumed_work = tmp_path / "resumed-work"
    resumed_work.mkdir()
    for name in ("train.npy", "val.npy", "heldout.txt"):
        (resumed_work / name).write_bytes((work / name).read_bytes())
    keep_best = train._keep_best

    def interrupt_after_first_save(model, step, val_loss, directory):
        keep_best(model, step, val_loss, directory)
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "_keep_best", interrupt_after_first_save)
    with pytest.raises(KeyboardInterrupt):
        _run(resumed_work, tmp_path / "unused")
    assert json.loads((resumed_work / "state.json").read_text())["step"] == 2
    monkeypatch.setattr(train, "_keep_best", keep_best)
    _run(resumed_work, tmp_path / "resumed")

    a = load_file(str(whole / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--n-head", "3"], "GPTConfig.n_embd (256) must be divisible by n_head (3)"),
     (["--steps", "0"], "--steps must be >= 1, got 0"),
     (["--warmup", "-10"], "--warmup must be >= 0, got -10"),
     (["--eval-every", "0"], "--eval-every must be >= 1, got 0"),
     (["--lr", "nan"], "--lr must be positive, got nan"),
     (["--lr", "inf"], "--lr must be positive, got inf"),
     (["--min-lr", "5"], "--min-lr must be in [0, --lr], got 5"),
     (["--dropout", "1"], "--dropout must be in [0, 1), got 1"),
     (["--clip", "-1"], "--clip must be positive"),
     (["--seed", "-1"], "--seed must be >= 0, got -1"),
     (["--work-dir", "{file}"], "' is a file; give a folder"),
     (["--out", "{file}"], "--out '"),
     (["--evaluate-only", "--out", "{empty}"], "has no training.json")],
)  # fmt: skip
def test_bad_values_and_paths_are_usage_errors_before_any_download_or_step(tmp_path, capsys, args, message):
    # (each went on to download the corpus, or to train, or ended in a traceback)
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    args = [a.format(file=tmp_path / "file", empty=tmp_path / "empty") for a in args]
    work = ["--work-dir", str(tmp_path / "new")] if "--work-dir" not in args else []
    with pytest.raises(SystemExit) as exit_info:
        train.main([*args, *work])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("python -m checkpoints.train: error: ") and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file"]  # (no work folder made)
