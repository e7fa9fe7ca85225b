"""checkpoints.tokenizer: GPT-2's BPE built offline from the vendored file, golden ids, integrity checks."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import checkpoints.tokenizer
from checkpoints import EOT_ID, load_tokenizer

ENDOFTEXT = "<|endoftext|>"


@pytest.fixture(scope="module")
def enc():
    return load_tokenizer()


@pytest.mark.parametrize(
    ("text", "ids"),
    [("Hello, world", [15496, 11, 995]), (" the", [262]), ("\n", [198]), ("The", [464]),
     # the literal text "<|endoftext|>" as GPT-2 splits it when it is not the special token
     (ENDOFTEXT, [27, 91, 437, 1659, 5239, 91, 29])],
)  # fmt: skip
def test_golden_ids(enc, text, ids):
    assert enc.encode_ordinary(text) == ids


def test_vocabulary(enc):
    assert enc.n_vocab == 50257
    assert EOT_ID == enc.eot_token == 50256
    assert enc.special_tokens_set == {ENDOFTEXT}
    assert enc.decode([EOT_ID]) == ENDOFTEXT


def test_special_token_only_when_asked(enc):
    text = f"a{ENDOFTEXT}b"
    assert enc.encode(text, allowed_special="all") == [64, EOT_ID, 65]
    # The documented rule: user text is ordinary text, so the literal string never becomes id 50256.
    ordinary = enc.encode_ordinary(text)
    assert EOT_ID not in ordinary
    assert enc.encode(text, disallowed_special=()) == ordinary
    assert enc.decode(ordinary) == text
    # tiktoken's own default is to refuse the text outright rather than guess.
    with pytest.raises(ValueError, match="disallowed special token '<\\|endoftext\\|>'"):
        enc.encode(text)


@pytest.mark.parametrize(
    "text",
    ["", " ", "héllo wörld", "日本語のテキスト", "你好\N{FULLWIDTH COMMA}世界", "emoji 🤖🎉 and 👩‍👩‍👧",
     "tabs\tand\r\nnewlines\n\n", "mixed 123 4567 ١٢٣ ∑∫ \U0001d518\U0001d52b\U0001d526\U0001d520"],
)  # fmt: skip
def test_round_trip_unicode(enc, text):
    ids = enc.encode_ordinary(text)
    assert all(0 <= i < EOT_ID for i in ids)
    assert enc.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_round_trip_any_text(text):
    assert load_tokenizer().decode(load_tokenizer().encode_ordinary(text)) == text


def test_cached(enc):
    assert load_tokenizer() is enc


def test_damaged_file_is_refused(tmp_path, monkeypatch):
    damaged = tmp_path / "r50k_base.tiktoken"
    shutil.copy(checkpoints.tokenizer.BPE_FILE, damaged)
    damaged.chmod(0o644)
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0x01  # one bit of one byte
    damaged.write_bytes(bytes(data))
    monkeypatch.setattr(checkpoints.tokenizer, "BPE_FILE", damaged)
    with pytest.raises(
        ValueError, match=f"has sha256 [0-9a-f]{{64}}, expected {checkpoints.tokenizer.BPE_SHA256}"
    ):
        load_tokenizer.__wrapped__()


def test_missing_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints.tokenizer, "BPE_FILE", tmp_path / "absent.tiktoken")
    with pytest.raises(
        ValueError, match=r"cannot read the tokenizer file .*absent\.tiktoken.*reinstall gptgen"
    ):
        load_tokenizer.__wrapped__()


def test_undamaged_copy_builds_the_same_encoding(tmp_path, monkeypatch, enc):
    copy = tmp_path / "r50k_base.tiktoken"
    shutil.copy(checkpoints.tokenizer.BPE_FILE, copy)
    monkeypatch.setattr(checkpoints.tokenizer, "BPE_FILE", copy)
    fresh = load_tokenizer.__wrapped__()
    assert fresh is not enc
    assert fresh.encode_ordinary("Hello, world 🤖") == enc.encode_ordinary("Hello, world 🤖")
