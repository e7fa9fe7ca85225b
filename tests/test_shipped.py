"""The shipped Shakespeare checkpoint: layout, size, loss on the recorded held-out slice, golden text."""

import json
import shlex
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import transformers

import checkpoints
import generate
from checkpoints.load import SHIPPED_DIR
from checkpoints.safetensors_io import read_header

DIRECTORY = SHIPPED_DIR / "shakespeare"
GOLDEN_PROMPT = "ROMEO:"
# Greedy, 24 new tokens, fp32, recorded from the shipped weights.
GOLDEN_TEXT = "\nAnd I am not so.\n\n[Exit.]\n\n[Enter a Messenger.]\n\nCASSI"


@pytest.fixture(scope="module")
def model():
    return checkpoints.load("shakespeare")


def test_shipped_layout_and_size():
    assert "shakespeare" in checkpoints.shipped_names()
    names = {p.name for p in DIRECTORY.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "training.json", "heldout.txt"} <= names
    assert (DIRECTORY / "model.safetensors").stat().st_size <= 40_000_000
    header = read_header(DIRECTORY / "model.safetensors")
    assert {info["dtype"] for info in header.values()} == {"F16"}  # 16-bit storage
    assert all(key.startswith("transformer.") for key in header)


def test_loads_in_transformers_with_the_same_logits(model):
    hf = transformers.GPT2LMHeadModel.from_pretrained(DIRECTORY, dtype=torch.float32).eval()
    ids = torch.tensor([checkpoints.load_tokenizer().encode_ordinary("Now is the winter of our discontent")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_card_slice_loss_recomputes(model):
    facts = json.loads((DIRECTORY / "training.json").read_text())
    ids = torch.tensor(facts["held_out_slice"]["token_ids"])
    with torch.no_grad():
        loss = F.cross_entropy(model(ids[None, :-1])[0], ids[1:]).item()
    assert abs(loss - facts["held_out_slice"]["loss"]) <= 1e-3
    assert facts["held_out_loss"] < facts["unigram_held_out_loss"]  # it learned more than word frequencies
    card = (DIRECTORY / "README.md").read_text()
    assert f"{facts['held_out_loss']:.4f}" in card and "CC-BY 2.5" in card


def test_scoring_the_held_out_text_gives_the_figure_on_the_card():
    """The card's command, `gptgen score heldout.txt`, reproduces the card's row: every one of the 69,267
    held-out tokens scored with at least 256 tokens of context. Run as the user runs it, in a process of its
    own with both cores (about 40 s on 2 cores: the suite's longest test, kept because the card's figure is
    what users compare with)."""
    facts = json.loads((DIRECTORY / "training.json").read_text())["held_out_text_score"]
    command = [sys.executable, "-m", "generate.tools.gptgen", "score", facts["file"], "--json"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=DIRECTORY, timeout=600)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    score = json.loads(proc.stdout)
    assert (score["tokens"], score["window"], score["stride"]) == (69_267, facts["window"], facts["stride"])
    assert score["tokens"] == facts["tokens"] == len(score["token_logprobs"]) == len(score["token_ids"]) - 1
    assert abs(score["mean_nll"] - facts["mean_nll"]) <= 1e-4
    card = (DIRECTORY / "README.md").read_text()
    row = f"{score['tokens']:,} tokens scored | {score['mean_nll']:.4f} | {score['perplexity']:.1f} |"
    assert row in card


def test_golden_greedy_text_offline(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the shipped model must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    gen = generate.load()  # the default checkpoint is the shipped one
    out = gen.generate(GOLDEN_PROMPT, max_new_tokens=24, temperature=0)
    assert out.text == GOLDEN_TEXT


def test_card_samples_are_what_their_commands_print():
    """The card's samples are unedited: the first one's command, run through the API, prints it again."""
    facts = json.loads((DIRECTORY / "training.json").read_text())
    sample = facts["samples"][0]
    argv = shlex.split(sample["command"])
    assert argv[:3] == ["generate", sample["prompt"], "--seed"] and argv[4] == "--max-new-tokens"
    gen = generate.load("shakespeare")
    out = gen.generate(
        sample["prompt"], seed=int(argv[3]), max_new_tokens=int(argv[5]), temperature=0.8, top_p=0.95
    )  # fmt: skip  (the command's defaults)
    assert out.text == sample["text"]
    assert sample["text"] in (DIRECTORY / "README.md").read_text()
