"""Attention pictures: `Generator.attention` returns the weights the forward uses (rows sum to 1, the future
exactly 0, equal to transformers' `output_attentions` within 1e-5), and `gptgen attention` writes a valid
image of the size asked for, or one line of error and no file."""

from __future__ import annotations

import io
import re
import struct
import sys

import pytest
import torch

import generate
from generate.tools.commands import attention_main
from helpers import make_model, save_hf
from model import GPTConfig

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind"
N_LAYER, N_HEAD, WINDOW = 3, 4, 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    hf = save_hf(directory, n_layer=N_LAYER, n_head=N_HEAD, n_embd=32, n_positions=WINDOW)
    hf.set_attn_implementation("eager")  # (SDPA returns no weights)
    return hf, generate.load(directory), directory


def test_the_weights_are_causal_softmax_rows_equal_to_transformers(pair):
    hf, gen, _ = pair
    weights = gen.attention(TEXT)
    t = len(gen.encode(TEXT))
    assert weights.shape == (N_LAYER, N_HEAD, t, t) and weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(N_LAYER, N_HEAD, t), atol=1e-6, rtol=0)
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    assert torch.all(weights[..., future] == 0)  # exactly 0, not merely small
    assert torch.all(weights[..., ~future] > 0)
    with torch.no_grad():
        expected = torch.stack(hf(torch.tensor([gen.encode(TEXT)]), output_attentions=True).attentions)[:, 0]
    torch.testing.assert_close(weights, expected, atol=1e-5, rtol=0)


def test_the_weights_are_those_the_forward_uses(pair):
    """Each layer's weights times its values, projected, equal that layer's attention output."""
    _, gen, _ = pair
    model = gen.model
    ids = torch.tensor([gen.encode(TEXT)])
    weights = gen.attention(TEXT)
    inputs = []

    def keep(module, args, out):
        inputs.append((args[0], out))

    hooks = [b.attn.register_forward_hook(keep) for b in model.h]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        for layer, (x, out) in enumerate(inputs):
            attn = model.h[layer].attn
            _, _, v = attn.c_attn(x).split(attn.d_out, dim=2)
            v = v.view(1, -1, N_HEAD, attn.head_dim).transpose(1, 2)  # (1, nh, T, hs)
            y = (weights[layer][None] @ v).transpose(1, 2).reshape(1, -1, attn.d_out)
            torch.testing.assert_close(attn.c_proj(y), out, atol=1e-5, rtol=0)


def test_an_empty_text_is_the_end_of_text_token_and_too_long_a_text_is_refused(pair):
    _, gen, _ = pair
    assert gen.attention("").shape == (N_LAYER, N_HEAD, 1, 1)
    with pytest.raises(ValueError, match=rf"the text has \d+ tokens but the window holds {WINDOW}"):
        gen.attention("word " * 40)


def test_a_token_beyond_a_small_models_vocabulary_is_refused_as_generate_refuses_it(tmp_path):
    save_hf(tmp_path, n_layer=1, n_head=2, n_embd=16, n_positions=WINDOW, vocab_size=100)
    with pytest.raises(ValueError, match=r"^token id \d+ is outside the vocabulary 0\.\.99$"):
        generate.load(tmp_path).attention("hello")  # (an IndexError from the embedding before)


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """A checkpoint with a NaN weight in its last layer's attention: that layer's weights are NaN."""
    import checkpoints

    model = make_model(GPTConfig(n_layer=2, n_head=2, n_embd=16, n_positions=WINDOW), std=0.3)
    with torch.no_grad():
        model.h[1].attn.c_attn.weight[0, 0] = float("nan")
    directory = tmp_path_factory.mktemp("broken")
    checkpoints.save(model, directory)
    return directory


def test_nan_weights_are_an_error_as_nan_logits_are(broken, tmp_path, capsys):
    gen = generate.load(broken)
    with pytest.raises(generate.GenerationError, match=r"NaN or infinite attention weights \(dtype torch"):
        gen.attention(TEXT)
    with pytest.raises(generate.GenerationError, match="the checkpoint may be corrupt"):
        gen.attention(TEXT, layer=1)
    assert torch.isfinite(gen.attention(TEXT, layer=0)).all()  # (the layers before it are sound)
    code, out, err = run([TEXT, "-o", tmp_path / "a.png", "-c", broken, "--layer", "1"], capsys)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("gptgen attention: error: the model produced NaN or infinite attention weights")
    assert list(tmp_path.iterdir()) == []


def test_a_quantized_model_gives_weights_close_to_fp32(pair):
    _, gen, directory = pair
    bf16 = generate.load(directory, dtype="int8").attention(TEXT)
    assert bf16.dtype == torch.float32
    assert (bf16 - gen.attention(TEXT)).abs().max() < 0.05
    torch.testing.assert_close(bf16.sum(-1), torch.ones(bf16.shape[:-1]), atol=3e-3, rtol=0)  # (the README's)


# --- the command ---


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def run(argv, capsys):
    try:
        code = attention_main([str(a) for a in argv])
    except SystemExit as e:  # a usage error
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("options", "size"),
    [([], (900, 860)),  # one layer's 4 heads as a 2 x 2 grid
     (["--layer", "2", "--head", "3"], (800, 700)),
     (["--layer", "-1", "--mean"], (800, 700)),
     (["--mask"], (800, 700)),
     (["--head", "0", "--size", "640x480"], (640, 480))],
    ids=["grid", "head", "mean", "mask", "size"],
)  # fmt: skip
def test_the_picture_is_a_valid_png_of_the_expected_size(pair, tmp_path, capsys, options, size):
    from PIL import Image

    _, _, directory = pair
    out = tmp_path / "attention.png"
    code, stdout, err = run([TEXT, "-o", out, "-c", directory, *options], capsys)
    assert code == 0 and stdout == ""
    assert err == f"wrote {out} ({len(generate.load(directory).encode(TEXT))} tokens)\n"
    assert png_size(out) == size
    with Image.open(out) as image:
        image.verify()
    with Image.open(out) as image:
        pixels = torch.tensor(list(image.convert("L").getdata()), dtype=torch.float32)
    assert pixels.std() > 10  # a picture, not a blank page
    assert not list(tmp_path.glob(".attention.png.*"))  # no temporary file left behind


def test_the_text_can_come_from_stdin_and_svg_is_written_too(pair, tmp_path, capsys, monkeypatch):
    _, _, directory = pair
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(TEXT.encode() + b"\n"), encoding="utf-8"))
    code, _, err = run(["-o", tmp_path / "a.svg", "-c", directory, "--head", "1"], capsys)
    assert code == 0, err
    assert (tmp_path / "a.svg").read_text().lstrip().startswith("<?xml")


def test_tokens_with_dollar_signs_are_labelled_as_text_not_parsed_as_math(pair, tmp_path, capsys):
    """GPT-2 has tokens "$$", " $$" and "$$$$": matplotlib reads a label with an even number of dollar
    signs as TeX math (an empty formula, or a parse error)."""
    from generate.tools.plot import attention_figure

    _, _, directory = pair
    text = "It cost $$ and $$$$ then"
    for options in (["--head", "0"], []):  # (labels on one panel; on a grid's)
        code, _, err = run([text, "-o", tmp_path / "a.png", "-c", directory, *options], capsys)
        assert code == 0 and err.startswith("wrote "), err
    figure = attention_figure(torch.eye(3), [" $$", "$$$$", "a"], titles=["t"])
    figure.savefig(io.BytesIO(), format="png")
    assert [label.get_text() for label in figure.axes[0].get_xticklabels()] == ["·$$", "$$$$", "a"]


@pytest.mark.parametrize(
    ("options", "status", "match"),
    [(["--layer", "3"], 2, r"--layer 3 is out of range; this model has layers 0\.\.2"),
     (["--layer", "-4"], 2, r"--layer -4 is out of range"),
     (["--head", "4"], 2, r"--head 4 is out of range; this model has heads 0\.\.3"),
     (["--head", "1", "--mean"], 2, "give --head or --mean, not both"),
     (["--mask", "--head", "1"], 2, "--mask draws the mask alone"),
     (["--mask", "--layer", "0"], 2, "--mask draws the mask alone; leave out --layer, --head and --mean"),
     (["--size", "10x10"], 2, r"--size '10x10' must be WIDTHxHEIGHT in pixels, each 100\.\.10000"),
     (["-o", "{dir}/a.bmp"], 2, r"--output .*a\.bmp' must end in \.png, \.svg, \.pdf"),
     (["-o", "{dir}/nowhere/a.png"], 2, r"--output '.*/a\.png': the folder .*nowhere does not exist"),
     (["-o", "/proc/a.png"], 2, r"--output '/proc/a\.png' cannot be written: "),  # (before the model runs)
     (["--size", "300x200"], 2, r"--size 300x200 is too small for 4 panels: give at least 600x500 "),
     (["--head", "1", "--size", "499x900"], 2, r"--size 499x900 is too small for 1 panel: give at least 5"),
     (["-o", "{dir}/d.png"], 2, r"--output .*d\.png' is a folder; give a file in it, such as .*/a\.png"),
     (["--text", "word " * 40], 1, rf"the text has \d+ tokens but the window holds {WINDOW}")],
)  # fmt: skip
def test_command_errors_are_one_line_and_write_nothing(pair, tmp_path, capsys, options, status, match):
    _, _, directory = pair
    options = [o.format(dir=tmp_path) for o in options]
    (tmp_path / "d.png").mkdir()  # (a folder named like a picture)
    text = TEXT
    if options[0] == "--text":
        text, options = options[1], []
    argv = [text, "-c", directory, *(options if "-o" in options else ["-o", tmp_path / "a.png", *options])]
    code, out, err = run(argv, capsys)
    assert code == status and out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(match, err), err
    assert list(tmp_path.iterdir()) == [tmp_path / "d.png"] and not any((tmp_path / "d.png").iterdir())


def test_without_matplotlib_the_command_says_what_to_install(pair, tmp_path, capsys, monkeypatch):
    _, _, directory = pair
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code, _, err = run([TEXT, "-o", tmp_path / "a.png", "-c", directory], capsys)
    assert code == 1
    assert err == (
        "gptgen attention: error: pictures need matplotlib; install the extra with pip install -e '.[plot]'\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_one_layer_is_that_layer_of_all(pair):
    _, gen, _ = pair
    everything = gen.attention(TEXT)
    assert torch.equal(gen.attention(TEXT, layer=1), everything[1])
    assert torch.equal(gen.attention(TEXT, layer=-1), everything[-1])
    for bad in (N_LAYER, -N_LAYER - 1, True, 1.0):
        with pytest.raises(ValueError, match=rf"layer={bad!r} is out of range; this model has layers 0\.\.2"):
            gen.attention(TEXT, layer=bad)
