"""Scoring (`Generator.score`, `gptgen score`): the window plan scores every token once with the promised
context, and the figures equal a direct `transformers` computation of the same definition on the same
weights, within 1e-4 nats/token (fp32)."""

from __future__ import annotations

import io
import itertools
import json
import math
import re
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import checkpoints
import generate
from checkpoints.load import SHIPPED_DIR
from generate.score import Window, plan_windows
from generate.tools.commands import score_main
from helpers import make_model, save_hf
from model import GPTConfig

WINDOW = 64
# English text of about 800 tokens: with a 64-token window, many windows.
TEXT = (SHIPPED_DIR / "shakespeare" / "heldout.txt").read_text(encoding="utf-8")[:3200]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random GPT-2 (GPT-2's vocabulary, a tiny body) saved by transformers, and our Generator on it."""
    directory = tmp_path_factory.mktemp("hf")
    hf = save_hf(directory, n_layer=2, n_head=2, n_embd=32, n_positions=WINDOW)
    return hf, generate.load(directory), directory


def hf_token_logprobs(hf, ids: list[int], window: int, stride: int) -> list[float]:
    """The definition, computed directly with transformers: walk the window ends (the first window from 0,
    each later end ``stride`` further, the last at the text's end); each window scores the tokens past the
    previous window's end, from its full forward's log-softmax (float64)."""
    logprobs: dict[int, float] = {}
    end, first = min(window, len(ids)), 1
    while True:
        begin = max(0, end - window)
        with torch.no_grad():
            logits = hf(torch.tensor([ids[begin:end]])).logits[0].double()
        table = torch.log_softmax(logits, dim=-1)
        for i in range(first, end):
            assert i - begin >= min(i, window - stride)  # the promised context
            logprobs[i] = table[i - 1 - begin, ids[i]].item()
        if end == len(ids):
            break
        first, end = end, min(end + stride, len(ids))
    assert sorted(logprobs) == list(range(1, len(ids)))  # every token after the first, once
    return [logprobs[i] for i in range(1, len(ids))]


@given(n=st.integers(2, 400), window=st.integers(2, 64), data=st.data())
def test_the_plan_scores_every_token_after_the_first_once_with_the_promised_context(n, window, data):
    stride = data.draw(st.integers(1, window - 1))
    windows = plan_windows(n, window, stride)
    scored = [i for w in windows for i in range(w.first, w.end)]
    assert scored == list(range(1, n))
    for w in windows:
        assert w.end - w.begin == min(window, n) and 0 <= w.begin < w.first <= w.end <= n
        # Each token has at least window - stride tokens before it in its window, or all before it.
        assert all(i - w.begin >= min(i, window - stride) for i in range(w.first, w.end))
    for earlier, later in itertools.pairwise(windows):
        assert later.end == min(earlier.end + stride, n)
    assert plan_windows(5, 8, 4) == [Window(0, 5, 1)]


@pytest.mark.parametrize("stride", [None, 1, 17, WINDOW - 1])
def test_a_text_many_windows_long_equals_transformers(pair, stride):
    hf, gen, _ = pair
    text = TEXT[:1000] if stride == 1 else TEXT  # (stride 1: a window per token)
    ids = gen.tokenizer.encode_ordinary(text)
    assert len(ids) > (3 if stride == 1 else 10) * WINDOW
    score = gen.score(text, stride=stride)
    expected = hf_token_logprobs(hf, ids, WINDOW, stride or WINDOW // 2)
    assert score.tokens == len(ids) - 1 == len(score.token_logprobs)
    assert score.token_ids == ids and score.window == WINDOW and score.stride == (stride or WINDOW // 2)
    assert max(abs(a - b) for a, b in zip(score.token_logprobs, expected, strict=True)) <= 1e-4
    assert abs(score.mean_nll - (-sum(expected) / len(expected))) <= 1e-4
    assert score.perplexity == pytest.approx(math.exp(score.mean_nll), rel=1e-12)


def test_a_text_shorter_than_the_window_equals_transformers(pair):
    hf, gen, _ = pair
    text = "To be, or not to be, that is the question"
    ids = gen.tokenizer.encode_ordinary(text)
    assert len(ids) < WINDOW
    score = gen.score(text)
    expected = hf_token_logprobs(hf, ids, WINDOW, WINDOW // 2)
    assert score.window == len(ids) and score.tokens == len(ids) - 1
    assert max(abs(a - b) for a, b in zip(score.token_logprobs, expected, strict=True)) <= 1e-4
    # The same as transformers' own loss with labels (its mean over the shifted tokens).
    with torch.no_grad():
        loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert abs(score.mean_nll - loss) <= 1e-4


def test_windows_batched_give_the_windows_alone(pair):
    _, gen, _ = pair
    alone = gen.score(TEXT, batch_size=1)
    for batch_size in (3, 64):
        batched = gen.score(TEXT, batch_size=batch_size)
        assert batched.tokens == alone.tokens
        torch.testing.assert_close(torch.tensor(batched.token_logprobs), torch.tensor(alone.token_logprobs),
                                   atol=1e-5, rtol=0)  # fmt: skip


def test_token_ids_score_like_their_text_and_progress_is_reported(pair):
    _, gen, _ = pair
    seen = []
    by_text = gen.score(TEXT, batch_size=4, progress=lambda done, total: seen.append((done, total)))
    by_ids = gen.score(gen.tokenizer.encode_ordinary(TEXT), batch_size=4)
    assert by_ids.token_logprobs == by_text.token_logprobs
    total = by_text.tokens
    assert seen[-1] == (total, total) and all(t == total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) > 1


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4"])
def test_other_dtypes_score_close_to_fp32(pair, dtype):
    _, gen, directory = pair
    reference = gen.score(TEXT)
    other = generate.load(directory, dtype=dtype).score(TEXT)
    assert other.tokens == reference.tokens
    assert abs(other.mean_nll - reference.mean_nll) < 0.05  # a random model's loss is ~10.8 nats


@pytest.mark.parametrize(
    ("text", "options", "error", "match"),
    [("", {}, ValueError, "the text has 0 tokens; scoring needs at least 2"),
     ("Hi", {}, ValueError, "the text has 1 token; scoring needs at least 2"),
     (TEXT, {"stride": 0}, ValueError, r"stride=0 is out of range; it must be an integer in 1\.\.63"),
     (TEXT, {"stride": WINDOW}, ValueError, r"stride=64 is out of range"),
     (TEXT, {"stride": 2.5}, ValueError, r"stride=2\.5 is out of range"),
     (TEXT, {"stride": True}, ValueError, r"stride=True is out of range"),
     (TEXT, {"batch_size": 0}, ValueError, "batch_size must be a positive integer, got 0"),
     ([1, 2, 60000], {}, ValueError, r"token id 60000 is outside the vocabulary 0\.\.50256"),
     (b"bytes", {}, TypeError, "got bytes; decode it first"),
     (["a", "b"], {}, TypeError, "a str or a list of token ids")],
)  # fmt: skip
def test_bad_input_is_refused_naming_the_value(pair, text, options, error, match):
    _, gen, _ = pair
    with pytest.raises(error, match=match):
        gen.score(text, **options)


# --- the command ---


def run(argv, capsys, monkeypatch, stdin: bytes = b"", tty: bool = False):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    code = exit_status(score_main, argv)
    out, err = capsys.readouterr()
    return code, out, err


def exit_status(main, argv) -> int:
    """A command's exit status: what it returns, or argparse's SystemExit code (2 for a usage error)."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


def test_the_command_prints_the_figures_and_json_has_everything(pair, tmp_path, capsys, monkeypatch):
    _, gen, directory = pair
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    expected = gen.score(TEXT, stride=20)
    code, out, err = run([tmp_path / "text.txt", "-c", directory, "--stride", "20"], capsys, monkeypatch)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"tokens      {expected.tokens:,}"
    assert lines[1] == f"mean NLL    {expected.mean_nll:.4f} nats/token"
    assert lines[2] == f"perplexity  {expected.perplexity:.2f}"
    assert lines[3].startswith(f"windows     {WINDOW} tokens, stride 20; ")
    (tmp_path / "short.txt").write_text(TEXT[:40], encoding="utf-8")  # (one window, shorter than a stride)
    code, out, err = run([tmp_path / "short.txt", "-c", directory, "--stride", "20"], capsys, monkeypatch)
    assert code == 0 and out.splitlines()[3].startswith("windows     one, the whole text; ")
    code, out, err = run(["-", "-c", directory, "--stride", "20", "--json"], capsys, monkeypatch,
                         stdin=TEXT.encode())  # fmt: skip
    record = json.loads(out)
    assert code == 0 and err == ""
    assert record.pop("file") == "-" and record.pop("seconds") > 0
    assert record == expected.to_dict()


def test_the_progress_bar_shows_on_a_terminal_and_is_cleared(pair, tmp_path, capsys, monkeypatch):
    _, _, directory = pair
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    argv = [tmp_path / "text.txt", "-c", directory, "--batch-size", "2"]
    code, _, err = run(argv, capsys, monkeypatch, tty=True)
    assert code == 0
    assert "scoring: " in err and f"/{len(pair[1].tokenizer.encode_ordinary(TEXT)) - 1:,} tokens (" in err
    assert err.endswith("\r\x1b[K")  # the bar is erased before the figures print
    code, _, err = run([*argv, "--no-progress"], capsys, monkeypatch, tty=True)
    assert code == 0 and err == ""


@pytest.mark.parametrize(
    ("argv", "status", "match"),
    [(["{missing}"], 1, r"gptgen score: error: cannot read file .*missing\.txt: No such file or directory"),
     (["{empty}"], 1, "gptgen score: error: the text has 0 tokens; scoring needs at least 2"),
     (["{text}", "--stride", "0"], 2, r"--stride must be >= 1, got 0"),
     (["{text}", "--stride", "64"], 2, r"--stride must be below the model's window of 64 tokens, got 64"),
     (["{text}", "--batch-size", "0"], 2, r"--batch-size must be >= 1, got 0"),
     (["{text}", "--group-size", "64"], 2, r"--group-size applies to --dtype int4"),
     ([], 2, "no text: give a file, or pipe the text to standard input")],
)  # fmt: skip
def test_command_errors_are_one_line(pair, tmp_path, capsys, monkeypatch, argv, status, match):
    _, _, directory = pair
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "text.txt").write_text(TEXT)
    paths = {name: tmp_path / f"{name}.txt" for name in ("missing", "empty", "text")}
    argv = [a.format(**paths) for a in argv] + ["-c", str(directory)]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b""), encoding="utf-8"))
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    code = exit_status(score_main, argv)
    out, err = capsys.readouterr()
    assert code == status and out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(match, err), err


@pytest.fixture(scope="module")
def extreme(tmp_path_factory):
    """A checkpoint whose logits are about 1e5: finite in fp32 (a mean NLL past exp's range), infinite in
    fp16."""
    model = make_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32), seed=0, std=0.3)
    with torch.no_grad():
        model.wte.weight.mul_(300.0)
        model.ln_f.weight.mul_(100.0)
    directory = tmp_path_factory.mktemp("extreme")
    checkpoints.save(model, directory)
    return directory


def test_non_finite_logits_are_an_error_and_a_huge_loss_an_infinite_perplexity(extreme, capsys, monkeypatch):
    with pytest.raises(generate.GenerationError, match=r"NaN or infinite logits \(dtype torch.float16\)"):
        generate.load(extreme, dtype="float16").score(TEXT[:200])
    score = generate.load(extreme).score(TEXT[:200])
    assert score.mean_nll > 709 and score.perplexity == math.inf
    code, out, err = run(["-", "-c", extreme, "--json"], capsys, monkeypatch, stdin=TEXT[:200].encode())
    assert code == 0 and json.loads(out)["perplexity"] is None  # JSON has no infinity: null, valid JSON
    argv = ["-", "-c", extreme, "--dtype", "float16"]
    code, out, err = run(argv, capsys, monkeypatch, stdin=b"To be or not")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("gptgen score: error: the model produced NaN or infinite logits")
