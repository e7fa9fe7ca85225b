"""TextTracker: incremental UTF-8 decoding, stop strings and the hold-back that keeps streaming exact."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import checkpoints
from generate.engine.text import TextTracker

ENC = checkpoints.load_tokenizer()
TOKEN_BYTES = ENC.decode_single_token_bytes
REPLACEMENT = "\ufffd"

# Token ids whose bytes are a fragment of a multi-byte character (checked in the tests that use them).
PARTY = ENC.encode_ordinary("🎉")  # b"\xf0\x9f", b"\x8e", b"\x89"


def feed(tokens, stop=()):
    """Feed tokens one at a time; return the tracker and every piece take() returned (the final one last)."""
    tracker = TextTracker(TOKEN_BYTES, stop)
    pieces = []
    for t in tokens:
        tracker.add(t)
        pieces.append(tracker.take())
    tracker.close()
    pieces.append(tracker.take(final=True))
    return tracker, pieces


MULTIBYTE = [
    "naïve café",
    "日本語のテキスト",
    "emoji 🎉👍🏽 mixed",
    "Ελληνικά и русский текст",
    "👨‍👩‍👧‍👦 family, 한국어, العربية",
    "plain ascii",
]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_token_by_token_decoding_rebuilds_the_text(text):
    tokens = ENC.encode_ordinary(text)
    tracker, pieces = feed(tokens)
    assert "".join(pieces) == text
    assert tracker.text == text
    assert not tracker.stopped
    for piece in pieces:
        assert REPLACEMENT not in piece


def test_the_test_strings_really_split_characters_across_tokens():
    # Guard for the test above: several of its strings have tokens that are not valid UTF-8 alone.
    partial = 0
    for text in MULTIBYTE:
        for t in ENC.encode_ordinary(text):
            try:
                TOKEN_BYTES(t).decode("utf-8")
            except UnicodeDecodeError:
                partial += 1
    assert partial >= 10


def test_a_split_character_appears_only_when_complete():
    assert [TOKEN_BYTES(t) for t in PARTY] == [b"\xf0\x9f", b"\x8e", b"\x89"]
    tracker = TextTracker(TOKEN_BYTES)
    assert tracker.add(PARTY[0]) is False
    assert tracker.take() == ""
    assert tracker.text == ""
    tracker.add(PARTY[1])
    assert tracker.take() == ""
    tracker.add(PARTY[2])
    assert tracker.take() == "🎉"
    assert tracker.text == "🎉"


def test_text_before_a_split_character_is_released():
    tokens = ENC.encode_ordinary("ok 🎉")
    tracker = TextTracker(TOKEN_BYTES)
    pieces = []
    for t in tokens:
        tracker.add(t)
        pieces.append(tracker.take())
    assert pieces[0] == "ok"
    assert "".join(pieces) == "ok 🎉"
    assert pieces[-1].endswith("🎉")
    assert "" in pieces  # the partial tokens gave nothing


def test_incomplete_bytes_at_the_end_become_a_replacement_character_on_close():
    tracker = TextTracker(TOKEN_BYTES)
    for t in ENC.encode_ordinary("abc") + PARTY[:2]:
        tracker.add(t)
    assert tracker.take() == "abc"
    assert tracker.text == "abc"
    tracker.close()
    assert tracker.text == "abc" + REPLACEMENT
    assert tracker.take(final=True) == REPLACEMENT
    assert tracker.take(final=True) == ""  # nothing is returned twice


def test_invalid_bytes_in_the_middle_are_replaced_as_tiktoken_does():
    a, b, c = (ENC.encode_ordinary(x)[0] for x in "abc")
    tokens = [a, PARTY[1], b, PARTY[0], c]
    tracker, pieces = feed(tokens)
    assert tracker.text == ENC.decode(tokens) == "a\ufffdb\ufffdc"
    assert "".join(pieces) == tracker.text


def test_random_byte_tokens_decode_like_tiktoken():
    # Single-byte tokens and character fragments, in random order: lots of invalid and partial UTF-8.
    pool = list(range(256)) + PARTY + ENC.encode_ordinary("日本👍🏽é")
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        tracker, pieces = feed(tokens)
        assert tracker.text == ENC.decode(tokens)
        assert "".join(pieces) == tracker.text


# --- stop strings ----------------------------------------------------------------------------------------


def test_text_is_cut_before_the_stop_string():
    text = "Hello world. The end. More text follows."
    tracker, pieces = feed(ENC.encode_ordinary(text), stop=["The end"])
    assert tracker.stopped
    assert tracker.text == "Hello world. "
    assert "".join(pieces) == "Hello world. "


def test_add_reports_the_stop_and_ignores_later_tokens():
    tracker = TextTracker(TOKEN_BYTES, ["world"])
    results = [tracker.add(t) for t in ENC.encode_ordinary("Hello world again")]
    assert results == [False, True, True]
    assert tracker.text == "Hello "
    tracker.add(ENC.encode_ordinary(" more")[0])
    assert tracker.text == "Hello "


def test_a_stop_string_spanning_several_tokens_is_found():
    text = "the quick brown fox jumps over the lazy dog"
    stop = "brown fox jum"
    tokens = ENC.encode_ordinary(text)
    # The stop string covers parts of several tokens, beginning and ending inside tokens' text.
    assert not any(stop in ENC.decode([t]) for t in tokens)
    tracker, pieces = feed(tokens, stop=[stop])
    assert tracker.stopped
    assert tracker.text == "the quick "
    assert "".join(pieces) == "the quick "


def test_a_stop_string_split_inside_a_multibyte_character_is_found():
    text = "party 🎉 time"
    tracker, pieces = feed(ENC.encode_ordinary(text), stop=["🎉 t"])
    assert tracker.text == "party "
    assert "".join(pieces) == "party "


@pytest.mark.parametrize("stops", [["dog", "fox"], ["fox", "dog"], ["zzz", "dog", "over", "fox"]])
def test_the_earliest_stop_string_wins(stops):
    text = "the quick brown fox jumps over the lazy dog"
    tracker, pieces = feed(ENC.encode_ordinary(text), stop=stops)
    assert tracker.text == "the quick brown "
    assert "".join(pieces) == tracker.text


def test_the_earliest_of_stops_completing_in_the_same_token_wins():
    tracker = TextTracker(lambda t: [b"abc", b"xyz123"][t], ["123", "yz"])
    tracker.add(0)
    assert tracker.add(1)
    assert tracker.text == "abcx"


def test_stream_never_shows_any_part_of_the_stop_string():
    text = "one two three four five six"
    stop = "four five"
    tracker = TextTracker(TOKEN_BYTES, [stop])
    streamed = ""
    for t in ENC.encode_ordinary(text):
        tracker.add(t)
        streamed += tracker.take()
        assert "one two three ".startswith(streamed)  # only settled text that stays in the final text
        assert "four" not in streamed
    tracker.close()
    streamed += tracker.take(final=True)
    assert streamed == tracker.text == "one two three "


def test_hold_back_releases_text_when_the_stop_string_does_not_complete():
    stop = "The end"
    tokens = ENC.encode_ordinary("Start. The entire story")
    tracker = TextTracker(TOKEN_BYTES, [stop])
    released, held = [], False
    for t in tokens:
        tracker.add(t)
        released.append(tracker.take())
        if tracker.text.endswith(" The"):
            assert "".join(released) == "Start. "  # "The" could begin the stop string: held back
            held = True
    assert held
    assert not tracker.stopped
    assert "".join(released) == "Start. The entire story"
    tracker.close()
    assert tracker.take(final=True) == ""
    assert tracker.text == "Start. The entire story"


def test_held_back_text_comes_out_on_the_final_take():
    tracker = TextTracker(TOKEN_BYTES, ["The end"])
    for t in ENC.encode_ordinary("It was The en"):
        tracker.add(t)
    assert tracker.take() == "It was "
    tracker.close()
    assert not tracker.stopped
    assert tracker.take(final=True) == "The en"
    assert tracker.text == "It was The en"


def test_no_stop_strings_means_no_hold_back():
    tracker = TextTracker(TOKEN_BYTES)
    for t in ENC.encode_ordinary("The end"):
        tracker.add(t)
    assert tracker.take() == "The end"


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab c.\n", min_size=0, max_size=40),
    stops=st.lists(st.text(alphabet="ab c.\n", min_size=1, max_size=5), min_size=1, max_size=3),
)
def test_streaming_with_stop_strings_is_exact(text, stops):
    tokens = ENC.encode_ordinary(text)
    tracker = TextTracker(TOKEN_BYTES, stops)
    snapshots = [""]
    for t in tokens:
        tracker.add(t)
        snapshots.append(snapshots[-1] + tracker.take())
    tracker.close()
    final = tracker.text
    assert snapshots[-1] + tracker.take(final=True) == final
    assert all(final.startswith(s) for s in snapshots)  # nothing streamed is ever taken back
    assert not any(s in final for s in stops)
    if tracker.stopped:
        assert any(text.startswith(final + s) for s in stops)
    else:
        assert final == text
