"""The OpenAI wire format: request bodies checked into jobs and requests, results shaped as OpenAI's."""

import math
import re

import pytest

import checkpoints
from generate.engine.request import Request
from generate.engine.sampling import SamplingParams
from generate.serving.openai_api import (
    CHAT_STOPS,
    APIError,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    parse_chat,
    parse_completion,
    render_chat,
    usage,
)

TOK = checkpoints.load_tokenizer()
VOCAB, WINDOW, EOS = 50257, 64, 50256
USER = [{"role": "user", "content": "Hi"}]
NAME = TokenText(TOK.decode_single_token_bytes)


def encode(text: str, field: str = "prompt") -> list[int]:
    return TOK.encode_ordinary(text) or [EOS]


def completion(**body) -> object:
    return parse_completion(body, encode=encode, decode=TOK.decode, vocab=VOCAB, window=WINDOW)


def chat(**body) -> object:
    return parse_chat({"messages": USER} | body, encode=encode, vocab=VOCAB, window=WINDOW)


def refused(parse, body: dict, param: str | None, match: str, code: str | None = "invalid_value") -> APIError:
    """Parse ``body`` expecting a 400 that names ``param``; returns the error for further checks."""
    with pytest.raises(APIError, match=match) as info:
        parse(**body)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.code == code
    assert info.value.type == "invalid_request_error"
    return info.value


# --- prompts -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "ids", "texts"),
    [
        ("Hello world", [[15496, 995]], ["Hello world"]),
        (["Hello", " world, again"], [[15496], [995, 11, 757]], ["Hello", " world, again"]),
        ([15496, 995], [[15496, 995]], ["Hello world"]),
        ([[15496], [995, 11]], [[15496], [995, 11]], ["Hello", " world,"]),
    ],
    ids=["string", "strings", "token-ids", "token-id-lists"],
)
def test_each_prompt_form_gives_its_token_ids(prompt, ids, texts):
    job = completion(prompt=prompt)
    assert job.prompts == ids
    assert job.prompt_texts == texts
    assert job.chat is False


@pytest.mark.parametrize(
    "prompt",
    [None, 5, [], [[]], [1, "a"], [True, 2], [[1.5]], {"text": "a"}, ["a", None]],
    ids=repr,
)
def test_malformed_prompts_are_refused(prompt):
    refused(completion, {"prompt": prompt}, "prompt", r"^prompt: it must be a string, a list of strings")


def test_at_most_64_prompts_per_request():
    assert len(completion(prompt=["a"] * 64).prompts) == 64
    refused(completion, {"prompt": ["a"] * 65}, "prompt", r"^prompt: got 65 prompts; at most 64 per request")


@pytest.mark.parametrize(
    ("prompt", "param"),
    [([1] * WINDOW, "prompt"), ("hello " * 100, "prompt"), ([[1], [2] * WINDOW], "prompt[1]")],
    ids=["ids", "text", "second-of-two"],
)
def test_a_prompt_that_fills_the_window_is_context_length_exceeded(prompt, param):
    error = refused(
        completion,
        {"prompt": prompt},
        param,
        rf"^{re.escape(param)}: the prompt has \d+ tokens but the model's window is 64 positions",
        code="context_length_exceeded",
    )
    assert "at most 63 prompt tokens" in error.message


def test_a_prompt_one_short_of_the_window_is_accepted():
    assert completion(prompt=[1] * (WINDOW - 1)).prompts == [[1] * (WINDOW - 1)]


@pytest.mark.parametrize(
    ("prompt", "param", "bad"),
    [([1, VOCAB], "prompt", VOCAB), ([[1], [2, -1]], "prompt[1]", -1)],
)
def test_token_ids_outside_the_vocabulary_are_refused(prompt, param, bad):
    refused(
        completion,
        {"prompt": prompt},
        param,
        rf"^{re.escape(param)}: the prompt has token id {bad} outside the vocabulary 0\.\.50256",
    )


# --- defaults ----------------------------------------------------------------------------------------------


def test_completion_defaults():
    job = completion(prompt="Hi")
    assert job.max_tokens == 16
    assert (job.n, job.seed, job.logprobs, job.stop, job.user) == (1, None, None, (), None)
    assert (job.echo, job.stream, job.include_usage) == (False, False, False)
    assert job.sampling == SamplingParams()


def test_chat_defaults_to_the_whole_window_and_no_logprobs():
    job = chat()
    assert job.chat is True
    assert job.max_tokens == WINDOW
    assert job.prompts == [encode("User: Hi\nAssistant:")]
    assert job.prompt_texts == ["User: Hi\nAssistant:"]
    assert (job.n, job.logprobs, job.echo, job.stream) == (1, None, False, False)
    assert job.sampling == SamplingParams()


def test_chat_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5).max_tokens == 5
    assert chat(max_completion_tokens=7).max_tokens == 7
    assert chat(max_completion_tokens=7, max_tokens=5).max_tokens == 7


def test_options_at_their_limits_are_accepted():
    job = completion(
        prompt="Hi",
        temperature=0,
        top_p=1,
        top_k=0,
        min_p=0,
        repetition_penalty=0.01,
        presence_penalty=-2,
        frequency_penalty=2,
        n=16,
        max_tokens=0,
        logprobs=20,
        seed=0,
        user="u1",
        model="any-name",
    )
    assert job.sampling == SamplingParams(
        temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=0.01,
        presence_penalty=-2.0, frequency_penalty=2.0,
    )  # fmt: skip
    assert isinstance(job.sampling.temperature, float)  # an integer in a float field becomes a float
    assert (job.n, job.max_tokens, job.logprobs, job.seed, job.user) == (16, 0, 20, 0, "u1")


# --- numeric fields: range and type ------------------------------------------------------------------------

FLOAT_LIMITS = {
    "temperature": (r">= 0 \(0 means greedy\)", [-0.1, -1]),
    "top_p": (r"in \(0, 1\]", [0, 0.0, 1.01, -0.5]),
    "min_p": (r"in \[0, 1\)", [1, 1.0, -0.01]),
    "repetition_penalty": (r"> 0 \(1 disables it\)", [0, -1.0]),
    "presence_penalty": (r"in \[-2, 2\]", [2.01, -3]),
    "frequency_penalty": (r"in \[-2, 2\]", [-2.5, 3]),
}
INT_LIMITS = {
    "top_k": (r"an integer >= 0", [-1]),
    "n": (r"an integer in 1\.\.16", [0, 17]),
    "max_tokens": (r"an integer >= 0", [-1]),
    "logprobs": (r"an integer in 0\.\.20", [-1, 21]),
    "seed": (r"an integer in 0\.\.18446744073709551615", [-1, 2**64]),
}
NOT_NUMBERS = [True, False, "1", [1], {"v": 1}, math.nan, math.inf, -math.inf]
BAD_VALUES = (
    [(f, v, limit) for f, (limit, values) in FLOAT_LIMITS.items() for v in values + NOT_NUMBERS]
    + [(f, v, limit) for f, (limit, values) in INT_LIMITS.items() for v in values + NOT_NUMBERS + [1.0, 2.5]]
)  # fmt: skip


@pytest.mark.parametrize(("name", "value", "limit"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_numeric_fields_out_of_range_or_of_the_wrong_type_are_refused(name, value, limit):
    refused(
        completion,
        {"prompt": "Hi", name: value},
        name,
        rf"^{name}: got {re.escape(repr(value))}; it must be {limit}$",
    )


@pytest.mark.parametrize(
    ("name", "value", "limit"),
    [
        ("top_logprobs", -1, r"an integer in 0\.\.20"),
        ("top_logprobs", 21, r"an integer in 0\.\.20"),
        ("top_logprobs", True, r"an integer in 0\.\.20"),
        ("max_completion_tokens", -1, "an integer >= 0"),
        ("max_completion_tokens", "5", "an integer >= 0"),
        ("max_completion_tokens", 5.0, "an integer >= 0"),
        ("max_tokens", -1, "an integer >= 0"),
        ("max_tokens", math.nan, "an integer >= 0"),
        ("temperature", math.inf, r">= 0 \(0 means greedy\)"),
        ("n", 17, r"an integer in 1\.\.16"),
    ],
)
def test_chat_numeric_fields_are_refused_naming_the_limit(name, value, limit):
    body = {name: value, "logprobs": True} if name == "top_logprobs" else {name: value}
    refused(chat, body, name, rf"^{name}: got {re.escape(repr(value))}; it must be {limit}$")


@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty"])
def test_a_huge_integer_in_a_float_field_is_a_400_not_an_overflow(name):
    # json.loads('{"temperature": 1000...0}') gives an int too large for a float: a 400 naming it, shortened.
    shortened = rf"^{name}: got 1000+\.\.\. \(401 characters\); it must be"
    refused(completion, {"prompt": "Hi", name: 10**400}, name, shortened)


def test_chat_max_tokens_is_checked_even_beside_max_completion_tokens():
    refused(chat, {"max_completion_tokens": 5, "max_tokens": "lots"}, "max_tokens", "^max_tokens: got 'lots'")


# --- fields: unknown, endpoint-specific, unsupported -------------------------------------------------------


@pytest.mark.parametrize(
    ("parse", "name"),
    [
        (completion, "temprature"),
        (completion, "messages"),
        (completion, "top_logprobs"),
        (completion, "max_completion_tokens"),
        (chat, "prompt"),
        (chat, "echo"),
    ],
)
def test_unknown_fields_are_refused_by_name(parse, name):
    body = {"prompt": "Hi", name: 1} if parse is completion else {name: 1}
    refused(parse, body, name, rf"^unrecognized request field '{name}'", code="unknown_field")


def test_a_body_that_is_not_an_object_is_refused():
    for parse in (parse_completion, parse_chat):
        kwargs = {"encode": encode, "vocab": VOCAB, "window": WINDOW}
        if parse is parse_completion:
            kwargs["decode"] = TOK.decode
        with pytest.raises(APIError, match=r"^the request body must be a JSON object, got list$") as info:
            parse(["Hi"], **kwargs)
        assert (info.value.status, info.value.param) == (400, None)


NO_OPS = [
    ("best_of", 1),
    ("best_of", None),
    ("suffix", ""),
    ("logit_bias", {}),
    ("tools", []),
    ("tool_choice", "none"),
    ("response_format", {"type": "text"}),
    ("parallel_tool_calls", None),
    ("metadata", None),
    ("store", False),
]
NOT_NO_OPS = [
    ("best_of", 2),
    ("suffix", " the end"),
    ("logit_bias", {"50256": -100}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}),
    ("parallel_tool_calls", True),
    ("metadata", {"k": "v"}),
    ("store", True),
]


@pytest.mark.parametrize("parse", [completion, chat], ids=["completion", "chat"])
@pytest.mark.parametrize(("name", "value"), NO_OPS, ids=[f"{n}={v!r}" for n, v in NO_OPS])
def test_unsupported_openai_fields_are_accepted_at_their_no_op_value(parse, name, value):
    plain = parse(prompt="Hi") if parse is completion else parse()
    with_field = parse(prompt="Hi", **{name: value}) if parse is completion else parse(**{name: value})
    assert with_field == plain


@pytest.mark.parametrize("parse", [completion, chat], ids=["completion", "chat"])
@pytest.mark.parametrize(("name", "value"), NOT_NO_OPS, ids=[f"{n}={v!r}" for n, v in NOT_NO_OPS])
def test_unsupported_openai_fields_are_refused_otherwise(parse, name, value):
    body = {"prompt": "Hi", name: value} if parse is completion else {name: value}
    refused(parse, body, name, rf"^{name}: got .*; this server does not support {name} \(leave it out\)$")


def test_user_must_be_a_string():  # (and the model: every endpoint's check, tests/test_server.py)
    refused(completion, {"prompt": "Hi", "user": 5}, "user", r"^user: got 5; it must be a string")


# --- stop, stream, logprobs, seed --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, ()), ("\n", ("\n",)), (["a", "bc"], ("a", "bc")), (["s"] * 8, ("s",) * 8)],
)
def test_stop_as_a_string_or_a_list(stop, expected):
    assert completion(prompt="Hi", stop=stop).stop == expected
    assert chat(stop=stop).stop == expected


@pytest.mark.parametrize("stop", ["", ["a", ""], [1], ["s"] * 9, {"s": 1}, 5, ("a",)], ids=repr)
def test_bad_stops_are_refused(stop):
    refused(
        completion,
        {"prompt": "Hi", "stop": stop},
        "stop",
        r"^stop: got .*; it must be a non-empty string or a list of at most 8 non-empty strings$",
    )


def test_stream_options_include_usage_only_with_stream():
    job = completion(prompt="Hi", stream=True, stream_options={"include_usage": True})
    assert (job.stream, job.include_usage) == (True, True)
    assert completion(prompt="Hi", stream=True, stream_options={}).include_usage is False
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage is True
    for stream in (False, None):
        body = {"prompt": "Hi", "stream_options": {"include_usage": True}, "stream": stream}
        refused(completion, body, "stream_options", "^stream_options: it applies only with stream: true$")
    refused(chat, {"stream_options": {}}, "stream_options", "it applies only with stream: true")


@pytest.mark.parametrize(
    "options", [{"include_usage": "yes"}, {"usage": True}, [], "include_usage"], ids=repr
)
def test_malformed_stream_options_are_refused(options):
    body = {"prompt": "Hi", "stream": True, "stream_options": options}
    refused(completion, body, "stream_options", r'it must be \{"include_usage": true\|false\}$')


@pytest.mark.parametrize(("name", "value"), [("stream", "true"), ("stream", 1), ("echo", 1), ("echo", "no")])
def test_booleans_must_be_true_or_false(name, value):
    refused(
        completion, {"prompt": "Hi", name: value}, name, rf"^{name}: got {value!r}; it must be true or false$"
    )


def test_chat_logprobs_and_top_logprobs():
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).logprobs == 3
    assert chat(logprobs=False).logprobs is None
    refused(chat, {"logprobs": "yes"}, "logprobs", "^logprobs: got 'yes'; it must be true or false$")


@pytest.mark.parametrize("body", [{"top_logprobs": 3}, {"top_logprobs": 0, "logprobs": False}])
def test_chat_top_logprobs_needs_logprobs(body):
    refused(chat, body, "top_logprobs", "^top_logprobs: it needs logprobs: true$")


@pytest.mark.parametrize(("seed", "n"), [(2**64 - 1, 1), (2**64 - 2, 2), (2**64 - 16, 16)])
def test_the_largest_seed_leaves_room_for_every_choice(seed, n):
    job = completion(prompt="Hi", seed=seed, n=n)
    assert [r.seed for r in job.requests(EOS)] == [seed + j for j in range(n)]
    assert job.requests(EOS)[-1].seed == 2**64 - 1


@pytest.mark.parametrize(("seed", "n"), [(2**64 - 1, 2), (2**64 - 15, 16)])
def test_a_seed_whose_last_choice_overflows_is_refused(seed, n):
    refused(
        completion,
        {"prompt": "Hi", "seed": seed, "n": n},
        "seed",
        rf"^seed: got {seed}; it must be an integer in 0\.\.{2**64 - n}$",
    )


# --- Job.requests ------------------------------------------------------------------------------------------


def test_requests_are_n_per_prompt_with_seeds_seed_plus_j():
    job = completion(prompt=["Hello", " world,"], n=3, seed=10, max_tokens=5, stop=["\n"], logprobs=2,
                     temperature=0.5)  # fmt: skip
    requests = job.requests(EOS)
    assert [r.prompt for r in requests] == [[15496]] * 3 + [[995, 11]] * 3
    assert [r.seed for r in requests] == [10, 11, 12] * 2
    for r in requests:
        assert r.max_new_tokens == 5 and r.eos_id == EOS and r.stop == ("\n",)
        assert r.sampling == SamplingParams(temperature=0.5)
        assert (r.logprobs, r.top_logprobs) == (True, 2)
    assert len({id(r) for r in requests}) == 6  # distinct requests, not one repeated


def test_unseeded_requests_have_no_seed_and_no_logprobs():
    requests = completion(prompt="Hi", n=2).requests(EOS)
    assert [(r.seed, r.logprobs, r.top_logprobs) for r in requests] == [(None, False, 0)] * 2


def test_completion_logprobs_zero_still_records_logprobs():
    [request] = completion(prompt="Hi", logprobs=0).requests(EOS)
    assert (request.logprobs, request.top_logprobs) == (True, 0)


def test_chat_requests_add_the_turn_stops_to_the_users():
    [request] = chat(stop=["###"], seed=4, max_completion_tokens=9).requests(EOS)
    assert request.stop == ("###", *CHAT_STOPS)
    assert CHAT_STOPS == ("\nUser:", "\nSystem:")
    assert (request.seed, request.max_new_tokens, request.prompt) == (4, 9, encode("User: Hi\nAssistant:"))
    [plain] = chat().requests(EOS)
    assert plain.stop == CHAT_STOPS
    assert completion(prompt="Hi").requests(EOS)[0].stop == ()


# --- the chat template -------------------------------------------------------------------------------------


def test_render_chat_system_and_user():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert render_chat(messages) == "System: Be brief.\nUser: Hi there\nAssistant:"


def test_render_chat_every_role_and_content_parts():
    messages = [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": []},
    ]
    assert render_chat(messages) == "System: Rules.\nUser: Hello\nAssistant: Hi.\nUser: \nAssistant:"


@pytest.mark.parametrize(
    ("messages", "param", "match"),
    [
        (None, "messages", r"^messages: it must be a non-empty list of \{role, content\} objects$"),
        ([], "messages", "^messages: it must be a non-empty list"),
        ("User: hi", "messages", "^messages: it must be a non-empty list"),
        (
            [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}],
            "messages[1]",
            r"^messages\[1\]: each message needs a role, one of system, developer, user, assistant$",
        ),
        (["hi"], "messages[0]", r"^messages\[0\]: each message needs a role"),
        ([{"content": "hi"}], "messages[0]", r"^messages\[0\]: each message needs a role"),
        ([{"role": ["user"], "content": "hi"}], "messages[0]", r"^messages\[0\]: each message needs a role"),
        ([{"role": {"a": 1}, "content": "hi"}], "messages[0]", r"^messages\[0\]: each message needs a role"),
        (
            [{"role": "user"}],
            "messages[0].content",
            r"^messages\[0\]\.content: got None; it must be a string",
        ),
        ([{"role": "user", "content": 5}], "messages[0].content", r"^messages\[0\]\.content: got 5;"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url"}]}],
            "messages[1].content",
            r"^messages\[1\]\.content: only text parts \(\{type: text, text\}\) are supported$",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            "messages[0].content",
            r"^messages\[0\]\.content: only text parts",
        ),
    ],
)
def test_bad_messages_are_refused_naming_the_message(messages, param, match):
    with pytest.raises(APIError, match=match) as info:
        render_chat(messages)
    assert (info.value.status, info.value.param) == (400, param)
    refused(chat, {"messages": messages}, param, match)


def test_a_chat_too_long_for_the_window_is_context_length_exceeded():
    long = [{"role": "user", "content": "hello " * 100}]
    refused(chat, {"messages": long}, "messages", "^messages: the prompt has", code="context_length_exceeded")


# --- errors, usage, logprobs -------------------------------------------------------------------------------


def test_api_error_body_has_exactly_openais_keys():
    error = refused(completion, {"prompt": "Hi", "n": 0}, "n", "^n: got 0")
    assert error.body() == {
        "error": {
            "message": "n: got 0; it must be an integer in 1..16",
            "type": "invalid_request_error",
            "param": "n",
            "code": "invalid_value",
        }
    }
    custom = APIError("no such model", status=404, param="model", code="model_not_found")
    assert list(custom.body()) == ["error"]
    assert set(custom.body()["error"]) == {"message", "type", "param", "code"}
    assert custom.status == 404 and str(custom) == "no such model"
    assert APIError("x").body()["error"] == {"message": "x", "type": "invalid_request_error", "param": None,
                                             "code": None}  # fmt: skip


def test_usage_counts_prompts_once_and_every_choice():
    a, b = Request([1, 2, 3]), Request([1, 2, 3])
    a.token_ids, b.token_ids = [5, 6], [7, 8, 9]
    assert usage([a, b], 3) == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert usage([], 4) == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}


def test_token_text_shows_a_partial_utf8_token_as_bytes():
    assert NAME(15496) == "Hello"
    snowman = TOK.encode_ordinary("☃")  # three UTF-8 bytes, split over two tokens
    assert snowman == [24583, 225]
    assert [NAME(t) for t in snowman] == ["bytes:\\xe2\\x98", "bytes:\\x83"]


def test_token_text_for_every_single_byte_token_that_is_not_utf8():
    partial = []
    for t in range(VOCAB):
        raw = TOK.decode_single_token_bytes(t)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            partial.append((t, raw))
    assert len(partial) > 100  # GPT-2 has hundreds: lone bytes 0x80..0xff and pieces of characters
    lone = next((t, raw) for t, raw in partial if len(raw) == 1)
    assert NAME(lone[0]) == f"bytes:\\x{lone[1][0]:02x}"
    assert all(NAME(t) == "bytes:" + "".join(f"\\x{b:02x}" for b in raw) for t, raw in partial)


def test_completion_logprobs_offsets_are_cumulative_from_the_start():
    tokens = TOK.encode_ordinary("Hello, world")
    assert tokens == [15496, 11, 995]
    top = [None, {11: -0.5, 13: -1.5}, {}]
    out = completion_logprobs(tokens, [None, -0.5, -2.0], top, NAME, 5)
    assert out == {
        "tokens": ["Hello", ",", " world"],
        "token_logprobs": [None, -0.5, -2.0],
        "text_offset": [5, 10, 11],
        "top_logprobs": [None, {",": -0.5, ".": -1.5}, {" world": -2.0}],  # (as OpenAI's: the token too)
    }


def test_completion_logprobs_offsets_point_into_the_text_after_a_multibyte_character():
    text = "a☃ b"
    tokens = TOK.encode_ordinary(text)
    out = completion_logprobs(tokens, [0.0] * len(tokens), [None] * len(tokens), NAME, 0)
    assert out["tokens"][-1] == " b"
    assert out["text_offset"][-1] == text.index(" b")  # 2; the function says 1 + 14 + 10 = 25


def test_chat_logprobs_entries():
    tokens = TOK.encode_ordinary("Hi☃")
    assert tokens == [17250, 24583, 225]
    top = [{17250: -0.1}, {}, {225: -0.2, 11: -3.0}]
    out = chat_logprobs(tokens, [-0.1, -0.3, -0.2], top, TOK.decode_single_token_bytes, NAME)
    assert out == {
        "content": [
            {"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
             "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]},
            {"token": "bytes:\\xe2\\x98", "logprob": -0.3, "bytes": [0xE2, 0x98], "top_logprobs": []},
            {"token": "bytes:\\x83", "logprob": -0.2, "bytes": [0x83],
             "top_logprobs": [{"token": "bytes:\\x83", "logprob": -0.2, "bytes": [0x83]},
                              {"token": ",", "logprob": -3.0, "bytes": [44]}]},
        ]
    }  # fmt: skip
    with pytest.raises(ValueError, match="zip"):
        chat_logprobs(tokens, [-0.1], top, TOK.decode_single_token_bytes, NAME)
