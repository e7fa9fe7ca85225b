"""The Python API: Generator.generate / stream on a tiny model with GPT-2's vocabulary."""

import re
from unittest import mock

import pytest
import torch

import checkpoints
import generate
from helpers import make_model
from model import GPTConfig

WINDOW = 128
CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=WINDOW)  # vocab_size 50257: GPT-2's
EOT = checkpoints.EOT_ID


@pytest.fixture(scope="module")
def gen() -> generate.Generator:
    return generate.Generator(make_model(CONFIG, seed=0, std=0.3))


@pytest.fixture(scope="module")
def eos_gen() -> generate.Generator:
    """A model whose every position predicts <|endoftext|> by a wide margin."""
    model = make_model(CONFIG, seed=1, std=0.3)
    with torch.no_grad():
        model.ln_f.weight.zero_()  # the final hidden state is the constant ln_f.bias ...
        model.ln_f.bias.fill_(1.0)
        model.wte.weight[EOT] = 10.0  # ... whose dot product with EOT's (tied) embedding dominates
    return generate.Generator(model)


def full_forward_logprobs(model, prompt_ids, new_ids):
    """Reference: log-softmax of the uncached full-sequence forward at each generated position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + new_ids]))[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids) - 1
    return [logp[start + j, t].item() for j, t in enumerate(new_ids)], logits[start : start + len(new_ids)]


# --- return types, prompts -------------------------------------------------------------------------------


def test_a_string_prompt_gives_one_completion(gen):
    out = gen.generate("Hello world", max_new_tokens=6, temperature=0)
    assert isinstance(out, generate.Completion)
    assert len(out.token_ids) == 6
    assert out.finish_reason == "length"
    assert out.prompt_tokens == 2
    assert out.logprobs is None
    assert out.text == gen.tokenizer.decode(out.token_ids)


def test_a_list_of_prompts_gives_completions_in_order(gen):
    prompts = ["Hello world", "A", "The quick brown fox jumps", "x y"]
    outs = gen.generate(prompts, max_new_tokens=5, temperature=0)
    assert isinstance(outs, list)
    assert [o.prompt_tokens for o in outs] == [len(gen.encode(p)) for p in prompts]
    alone = [gen.generate(p, max_new_tokens=5, temperature=0) for p in prompts]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert [o.text for o in outs] == [a.text for a in alone]
    # A narrower engine, the list running three at a time, gives the same answers, still in order.
    narrow = generate.Generator(gen.model, gen.tokenizer, slots=3)
    chunked = narrow.generate(prompts, max_new_tokens=5, temperature=0)
    assert [o.token_ids for o in chunked] == [a.token_ids for a in alone]


PROMPTS = ["Hello world", "A", "The quick brown fox jumps over", "x y", "To be, or not", "1 2 3 4 5 6", "z"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "int4"])
def test_a_prompt_alone_and_in_a_list_gives_the_same_bits(dtype, tmp_path):
    # Deterministic: every call runs in an engine of `slots` rows, a lone prompt included, so
    # its tokens and logprobs are the same bits alone as in a list longer than the engine (run in turns).
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, n_positions=WINDOW)
    checkpoints.save(make_model(config, seed=3, std=0.1), tmp_path)
    gen = generate.load(tmp_path, dtype=dtype, slots=4, deterministic=True)
    options = dict(max_new_tokens=12, temperature=0.8, top_p=0.9, logprobs=True)
    together = gen.generate(PROMPTS, seed=list(range(len(PROMPTS))), **options)
    for i, prompt in enumerate(PROMPTS):
        alone = gen.generate(prompt, seed=i, **options)
        assert (alone.token_ids, alone.logprobs) == (together[i].token_ids, together[i].logprobs), prompt
    assert gen.engine(4, 8).slots == 4


def test_without_determinism_a_lone_prompt_runs_in_one_row():
    model = make_model(CONFIG, seed=0, std=0.3)
    fast = generate.Generator(model)
    assert (fast.width(1), fast.width(5), fast.width(100)) == (1, 5, 8)
    compiled = generate.Generator(model, compile=True)  # (two compiled steps at most: 1 row and 8)
    assert (compiled.width(1), compiled.width(2), compiled.width(100)) == (1, 8, 8)
    sure = generate.Generator(model, deterministic=True)
    assert (sure.width(1), sure.width(100)) == (8, 8)
    assert [o.token_ids for o in fast.generate(PROMPTS, max_new_tokens=5, temperature=0)] == [
        o.token_ids for o in sure.generate(PROMPTS, max_new_tokens=5, temperature=0)
    ]


def test_an_empty_list_gives_an_empty_list(gen):
    assert gen.generate([], max_new_tokens=5) == []


def test_an_empty_prompt_starts_from_endoftext(gen):
    assert gen.encode("") == [EOT]
    out = gen.generate("", max_new_tokens=4, temperature=0)
    assert out.prompt_tokens == 1
    assert len(out.token_ids) == 4
    with torch.no_grad():
        first = int(gen.model(torch.tensor([[EOT]]))[0, -1].argmax())
    assert out.token_ids[0] == first


def test_endoftext_inside_a_prompt_is_plain_text(gen):
    ids = gen.encode("before <|endoftext|> after")
    assert EOT not in ids
    assert gen.tokenizer.decode(ids) == "before <|endoftext|> after"
    assert gen.generate("<|endoftext|>", max_new_tokens=1, temperature=0).prompt_tokens == 7


def test_a_prompt_that_is_not_a_string_raises(gen):
    with pytest.raises(TypeError, match=r"a prompt must be a str, got int"):
        gen.generate([1, 2], max_new_tokens=2)


# --- streaming -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0},
        {"temperature": 1.0, "seed": 3},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 11},
        {"temperature": 1.0, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "seed": 5},
    ],
    ids=["greedy", "sampled", "filtered", "penalized"],
)
def test_stream_joins_to_the_generated_text(gen, options):
    for prompt in ("Once upon a time", ""):
        expected = gen.generate(prompt, max_new_tokens=24, **options)
        pieces = list(gen.stream(prompt, max_new_tokens=24, **options))
        assert "".join(pieces) == expected.text
        assert all(pieces)  # no empty pieces
        assert len(expected.text) > 0


def test_stream_with_a_stop_string_joins_to_the_generated_text(gen):
    for options in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        full = gen.generate("Once upon a time", max_new_tokens=24, **options)
        pieces = [gen.tokenizer.decode([t]) for t in full.token_ids]
        start = len("".join(pieces[:5]))
        stop = full.text[start + 2 : start + len(pieces[5]) + 3]  # from inside token 5 into token 6
        # Reference: the text before the first occurrence; the tokens up to the one completing it.
        n = next(n for n in range(1, 25) if stop in gen.tokenizer.decode(full.token_ids[:n]))
        assert n >= 2
        cut = gen.generate("Once upon a time", max_new_tokens=24, stop=stop, **options)
        assert cut.text == full.text[: full.text.index(stop)]
        assert cut.finish_reason == "stop"
        assert cut.token_ids == full.token_ids[:n]
        streamed = list(gen.stream("Once upon a time", max_new_tokens=24, stop=[stop], **options))
        assert "".join(streamed) == cut.text


def test_stream_completion_returns_the_completion(gen):
    run = gen.stream_completion("Hello", max_new_tokens=8, seed=2, logprobs=True)
    pieces = []
    with pytest.raises(StopIteration) as done:
        while True:
            pieces.append(next(run))
    completion = done.value.value
    assert completion == gen.generate("Hello", max_new_tokens=8, seed=2, logprobs=True)
    assert "".join(pieces) == completion.text


def test_stream_rejects_unknown_options(gen):
    with pytest.raises(TypeError, match=r"unknown option\(s\) temprature"):
        next(gen.stream("Hello", temprature=0.5))


# --- seeds -----------------------------------------------------------------------------------------------


def test_a_seed_gives_the_same_text_alone_and_in_a_batch(gen):
    options = {"max_new_tokens": 20, "temperature": 1.0, "top_p": 0.9}
    alone = gen.generate("The cat sat", seed=42, **options)
    assert alone == gen.generate("The cat sat", seed=42, **options)
    batch = ["x", "The cat sat", "A much longer prompt, with many more words in it than the others"]
    outs = gen.generate(batch, seed=42, **options)
    assert outs[1].token_ids == alone.token_ids
    assert outs[1].text == alone.text
    # Per-prompt seeds: the row with seed 42 matches too, wherever it is.
    outs = gen.generate(list(reversed(batch)), seed=[1, 42, 2], **options)
    assert outs[1].token_ids == alone.token_ids


def test_different_seeds_usually_differ(gen):
    texts = {gen.generate("The cat sat", max_new_tokens=10, seed=s).text for s in range(5)}
    assert len(texts) >= 4


def test_a_wrong_number_of_seeds_raises(gen):
    with pytest.raises(ValueError, match=r"got 3 seeds for 2 prompts"):
        gen.generate(["a", "b"], seed=[1, 2, 3], max_new_tokens=2)


# --- budget, EOS ------------------------------------------------------------------------------------------


def test_zero_new_tokens_gives_empty_text(gen):
    out = gen.generate("Hello", max_new_tokens=0)
    assert out.text == ""
    assert out.token_ids == []
    assert out.finish_reason == "length"
    assert list(gen.stream("Hello", max_new_tokens=0)) == []


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_a_bad_max_new_tokens_raises(gen, value):
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 0, got "):
        gen.generate("Hello", max_new_tokens=value)


def test_the_budget_ends_with_length(gen):
    out = gen.generate("Hello", max_new_tokens=9, seed=0)
    assert len(out.token_ids) == 9
    assert out.finish_reason == "length"


@pytest.mark.parametrize("options", [{"temperature": 0}, {"temperature": 1.0, "seed": 0}])
def test_eos_ends_the_text_with_stop(eos_gen, options):
    out = eos_gen.generate("Hello there", max_new_tokens=10, **options)
    assert out.finish_reason == "stop"
    assert out.text == ""
    assert out.token_ids == [EOT]
    assert list(eos_gen.stream("Hello there", max_new_tokens=10, **options)) == []


def test_eos_ends_every_row_of_a_batch(eos_gen):
    outs = eos_gen.generate(["a", "b c d"], max_new_tokens=5, temperature=0)
    assert [o.token_ids for o in outs] == [[EOT], [EOT]]
    assert [o.finish_reason for o in outs] == ["stop", "stop"]


# --- logprobs ---------------------------------------------------------------------------------------------


def test_logprobs_match_the_full_forward_for_greedy(gen):
    prompt = "In a hole in the ground"
    out = gen.generate(prompt, max_new_tokens=16, temperature=0, logprobs=True)
    assert len(out.logprobs) == len(out.token_ids) == 16
    assert all(lp <= 0 for lp in out.logprobs)
    expected, logits = full_forward_logprobs(gen.model, gen.encode(prompt), out.token_ids)
    assert out.token_ids == logits.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)


def test_sampled_logprobs_are_the_models_own_before_temperature(gen):
    prompt = "In a hole"
    options = {"max_new_tokens": 16, "temperature": 1.7, "top_k": 40, "seed": 9, "logprobs": True}
    out = gen.generate(prompt, **options)
    assert len(out.logprobs) == len(out.token_ids) == 16
    assert all(lp <= 0 for lp in out.logprobs)
    expected, _ = full_forward_logprobs(gen.model, gen.encode(prompt), out.token_ids)
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
    # logprobs=True does not change what is sampled.
    del options["logprobs"]
    assert gen.generate(prompt, **options).token_ids == out.token_ids


def test_logprobs_include_the_eos_token(eos_gen):
    out = eos_gen.generate("Hi", max_new_tokens=4, logprobs=True, temperature=0)
    assert out.token_ids == [EOT]
    assert len(out.logprobs) == 1
    assert -1e-3 < out.logprobs[0] <= 0


# --- the window ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [WINDOW, WINDOW + 30])
def test_a_prompt_that_fills_the_window_raises(gen, length):
    prompt = " a" * length
    assert len(gen.encode(prompt)) == length
    message = rf"has {length} tokens but the model's window is {WINDOW} positions"
    with pytest.raises(ValueError, match=message):
        gen.generate(prompt, max_new_tokens=1)


def test_a_prompt_one_short_of_the_window_gets_one_token(gen):
    assert len(gen.generate(" a" * (WINDOW - 1), max_new_tokens=5).token_ids) == 1  # the last position


def test_generation_stops_at_the_window_end(gen):
    out = gen.generate(" a" * 120, max_new_tokens=50, temperature=0)
    assert out.finish_reason == "length"
    assert out.prompt_tokens + len(out.token_ids) == WINDOW
    assert EOT not in out.token_ids
    # Batched with a short prompt: the long row stops at the window, the short one runs its budget.
    outs = gen.generate([" a" * 120, "b"], max_new_tokens=50, temperature=0)
    assert outs[0].token_ids == out.token_ids
    assert len(outs[1].token_ids) == 50


# --- stop strings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [[""], ["ok", ""], ""])
def test_an_empty_stop_string_raises(gen, stop):
    with pytest.raises(ValueError, match=r"stop strings must be non-empty strings, got ''"):
        gen.generate("Hello", max_new_tokens=3, stop=stop)


def test_a_non_string_stop_raises(gen):
    with pytest.raises(ValueError, match=r"stop strings must be non-empty strings, got 3"):
        gen.generate("Hello", max_new_tokens=3, stop=["ok", 3])


def test_a_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(gen):
    # The text is cut by the stop string, so the reason is "stop", even though the budget was also spent.
    full = gen.generate("Hello world", max_new_tokens=9, temperature=0)
    assert full.finish_reason == "length"
    longer = gen.generate("Hello world", max_new_tokens=10, temperature=0, stop=full.text)
    assert (longer.text, longer.finish_reason, len(longer.token_ids)) == ("", "stop", 9)
    exact = gen.generate("Hello world", max_new_tokens=9, temperature=0, stop=full.text)
    assert exact.text == ""
    assert exact.finish_reason == "stop"


def test_sampling_parameters_are_validated(gen):
    with pytest.raises(ValueError, match=r"top_p=1\.5 is out of range"):
        gen.generate("Hello", top_p=1.5)
    with pytest.raises(ValueError, match=r"slots must be a positive integer, got 0"):
        generate.Generator(gen.model, gen.tokenizer, slots=0)


def test_a_whitespace_only_prompt_is_a_prompt(gen):
    out = gen.generate("   \n\t", max_new_tokens=3, temperature=0)
    assert out.prompt_tokens == len(gen.encode("   \n\t")) > 0
    assert len(out.token_ids) == 3


def test_a_list_error_names_the_prompt_by_its_index_before_any_batch_runs(gen, monkeypatch):
    ran = []
    monkeypatch.setattr(generate.api, "Engine", lambda *a, **k: ran.append(1))
    prompts = ["short"] * 20 + ["word " * WINDOW]
    with pytest.raises(
        ValueError, match=r"^prompt 20: the prompt has \d+ tokens but the model's window is 128"
    ):
        gen.generate(prompts, max_new_tokens=2)
    assert ran == []  # nothing was generated for the first 20 prompts


def test_a_padded_vocabulary_only_yields_tokens_the_tokenizer_spells():
    # Checkpoints often pad the vocabulary to a round size (50304); ids past 50256 have no text.
    model = make_model(GPTConfig(n_layer=1, n_head=2, n_embd=32, n_positions=32, vocab_size=50304), seed=0)
    with torch.no_grad():
        model.wte.weight[50257:] = 5.0  # make the padding ids the most likely by far
    gen_padded = generate.Generator(model)
    for temperature in (0, 1.0):
        out = gen_padded.generate("Hi", max_new_tokens=8, temperature=temperature, seed=0, logprobs=True)
        assert max(out.token_ids) < 50257
        assert len(out.token_ids) == 8 and all(lp <= 0 for lp in out.logprobs)


def test_prompts_from_any_iterable_and_binary_ones_named(gen):
    texts = ["a prompt", "another"]
    expected = gen.generate(texts, max_new_tokens=3, temperature=0)
    got = gen.generate((t for t in texts), max_new_tokens=3, temperature=0)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    with pytest.raises(TypeError, match=r"a prompt must be a str, got bytes; decode it first"):
        gen.generate(b"a prompt")
    with pytest.raises(TypeError, match=r"a prompt must be a str, got int"):
        gen.generate(5)


# --- overlapping calls on one Generator ------------------------------------------------------------------

OVERLAP_OPTIONS = {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "logprobs": True}
OVERLAP_PROMPTS = ["To be", "or not to be", "that is", "the question"]


@pytest.fixture(scope="module")
def wide_gen() -> generate.Generator:
    """Deterministic: every call runs in 2 rows, so overlapping calls share an engine of one width."""
    return generate.Generator(make_model(CONFIG, seed=0, std=0.3), slots=2, deterministic=True)


def alone(gen: generate.Generator) -> dict[str, generate.Completion]:
    return {p: gen.generate(p, seed=i, **OVERLAP_OPTIONS) for i, p in enumerate(OVERLAP_PROMPTS)}


def test_streams_read_in_turn_each_give_what_they_give_alone(wide_gen):
    expected = alone(wide_gen)
    streams = {p: wide_gen.stream_completion(p, seed=i, **OVERLAP_OPTIONS) for i, p in enumerate(expected)}
    texts, done = dict.fromkeys(expected, ""), {}
    while len(done) < len(streams):  # one piece from each stream in turn (zip would drop a piece at the end)
        for p, stream in streams.items():
            if p not in done:
                try:
                    texts[p] += next(stream)
                except StopIteration as end:
                    done[p] = end.value
    assert texts == {p: c.text for p, c in expected.items()}
    assert {p: c.logprobs for p, c in done.items()} == {p: c.logprobs for p, c in expected.items()}
    assert not wide_gen._engine.has_work


def test_threads_calling_one_generator_each_get_what_they_get_alone(wide_gen):
    import threading

    expected = alone(wide_gen)
    got: dict[str, generate.Completion] = {}
    errors: list[BaseException] = []

    def call(i: int, prompt: str) -> None:
        try:
            for _ in range(3):
                got[prompt] = wide_gen.generate(prompt, seed=i, **OVERLAP_OPTIONS)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i, p)) for i, p in enumerate(expected)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert {p: (c.text, c.logprobs) for p, c in got.items()} == {
        p: (c.text, c.logprobs) for p, c in expected.items()
    }


def test_an_abandoned_stream_changes_nothing_and_is_cancelled_when_closed(wide_gen):
    expected = alone(wide_gen)
    held = wide_gen.stream("To be", seed=0, **OVERLAP_OPTIONS)
    next(held)  # read once, then left unread (still referenced)
    later = wide_gen.generate("that is", seed=2, **OVERLAP_OPTIONS)
    assert (later.text, later.logprobs) == (expected["that is"].text, expected["that is"].logprobs)
    held.close()
    assert not wide_gen._engine.has_work
    for _, piece in zip(range(2), wide_gen.stream("To be", seed=0, **OVERLAP_OPTIONS), strict=False):
        assert piece  # a loop broken off: its request is cancelled at once
    assert not wide_gen._engine.has_work


def test_a_call_beside_a_busy_kept_engine_with_no_free_slot_runs_in_its_own_not_after_the_other():
    # Not deterministic, the default: a lone prompt runs in one row, so a second lone call finds no free slot.
    gen = generate.Generator(make_model(CONFIG, seed=0, std=0.3), slots=2)
    expected = alone(gen)
    held = gen.stream_completion("To be", seed=0, **OVERLAP_OPTIONS)
    first = next(held)  # read once, then left unread (still referenced)
    busy = gen._engine
    (request,) = busy.running.values()
    made = len(request.token_ids)
    later = gen.generate("that is", seed=2, **OVERLAP_OPTIONS)
    assert len(request.token_ids) == made  # (it waited for the held call to end: 12 tokens)
    assert (later.text, later.logprobs) == (expected["that is"].text, expected["that is"].logprobs)
    assert gen._engine is busy  # the other engine was not kept
    text = first + "".join(iter(lambda: next(held, None), None))
    assert text == expected["To be"].text and not busy.has_work
    # Where memory allows no engine of its own, the call waits in the kept one, as before.
    held = gen.stream("To be", seed=0, **OVERLAP_OPTIONS)
    next(held)
    with mock.patch.object(generate.api, "Engine", side_effect=MemoryError("no memory")):
        later = gen.generate("that is", seed=2, **OVERLAP_OPTIONS)
    assert (later.text, later.logprobs) == (expected["that is"].text, expected["that is"].logprobs)
    assert not gen._engine.has_work  # (the held call's request ran to its end first)


def _inside_the_next_decode(gen: generate.Generator, monkeypatch, act) -> None:
    """Run ``act`` inside the kept engine's next decode step, after its forward (once)."""
    runner = gen._engine.runner
    real = runner.decode

    def decode(*args):
        out = real(*args)
        monkeypatch.setattr(runner, "decode", real)
        act()
        return out

    monkeypatch.setattr(runner, "decode", decode)


def test_a_stream_the_garbage_collector_closes_inside_another_calls_step_is_cancelled_after_it(
    wide_gen, monkeypatch
):
    import gc

    expected = alone(wide_gen)

    class Holder:  # (a stream held in a reference cycle: closed whenever the collector runs)
        pass

    held = Holder()
    held.self, held.stream = held, wide_gen.stream("To be", seed=0, **OVERLAP_OPTIONS)
    next(held.stream)
    del held
    _inside_the_next_decode(wide_gen, monkeypatch, gc.collect)
    later = wide_gen.generate("that is", seed=2, **OVERLAP_OPTIONS)  # (a KeyError: its slot freed mid-step)
    assert (later.text, later.logprobs) == (expected["that is"].text, expected["that is"].logprobs)
    assert not wide_gen._engine.has_work


def test_an_interrupt_inside_a_step_ends_the_engines_other_requests_in_an_error_not_other_text(
    wide_gen, monkeypatch
):
    expected = alone(wide_gen)["To be"]
    stream = wide_gen.stream("To be", seed=0, **OVERLAP_OPTIONS)
    got = next(stream)
    engine = wide_gen._engine

    def interrupt():
        raise KeyboardInterrupt  # (Ctrl-C once the forward ran, before the step chose its tokens)

    _inside_the_next_decode(wide_gen, monkeypatch, interrupt)
    with pytest.raises(KeyboardInterrupt):
        wide_gen.generate("that is", seed=2, **OVERLAP_OPTIONS)
    with pytest.raises(generate.GenerationError, match=r"a step was interrupted .* generate it again"):
        for piece in stream:  # (went on with other text: the slot's position had advanced, not its token)
            got += piece
    assert expected.text.startswith(got) and wide_gen._engine is not engine
    assert wide_gen.generate("To be", seed=0, **OVERLAP_OPTIONS).text == expected.text  # a fresh engine


def test_numpy_and_torch_arguments_are_read_as_their_python_values(gen):
    np = pytest.importorskip("numpy")  # (each was refused: "got np.int64(2)", "seed=array([1, 2])", ...)
    two = ["To be", "or not"]
    a = gen.generate(two, seed=np.array([1, 2]), max_new_tokens=4)
    assert [c.token_ids for c in a] == [c.token_ids for c in gen.generate(two, seed=[1, 2], max_new_tokens=4)]
    ids = gen.encode("To be, or not to be, that is the question")
    want = gen.score(ids)
    for text, size in ((np.array(ids), 4), (torch.tensor(ids), np.int64(2))):
        got = gen.score(text, batch_size=size)
        assert (got.mean_nll, got.token_logprobs) == (want.mean_nll, want.token_logprobs)
    assert generate.Generator(gen.model, slots=np.int64(2)).slots == 2


@pytest.mark.parametrize(
    ("option", "match"),
    [({"temperature": -5}, "temperature"), ({"max_new_tokens": -1}, "max_new_tokens"),
     ({"seed": "x"}, "seed"), ({"stop": ""}, "stop strings must be non-empty"),
     ({"logprobs": "no"}, "logprobs must be True or False")],
)  # fmt: skip
def test_bad_options_are_refused_with_no_prompts_as_with_one(gen, option, match):
    with pytest.raises(ValueError, match=match):
        gen.generate("x", **option)
    with pytest.raises(ValueError, match=match):
        gen.generate([], **option)  # (it returned [])
    assert gen.generate([], max_new_tokens=3) == []


def test_a_draft_the_dtype_does_not_suit_is_named_in_the_error(tmp_path):
    # The target takes int4 groups of 32 (width 32); a draft of width 48 cannot: the error names the draft.
    checkpoints.save(make_model(CONFIG), tmp_path / "target")
    draft_config = GPTConfig(n_layer=1, n_head=2, n_embd=48, n_positions=WINDOW)
    checkpoints.save(make_model(draft_config), tmp_path / "d")
    draft, missing = (re.escape(str(tmp_path / name)) for name in ("d", "none"))
    with pytest.raises(ValueError, match=rf"^the draft {draft}: int4 with group_size 32 .* width 48"):
        generate.load(tmp_path / "target", dtype="int4", draft=tmp_path / "d")
    with pytest.raises(checkpoints.CheckpointError, match=rf"^the draft {missing}: checkpoint path"):
        generate.load(tmp_path / "target", dtype="int4", draft=tmp_path / "none")
    with pytest.raises(checkpoints.CheckpointError, match=r"^the draft: the checkpoint path is empty"):
        generate.load(tmp_path / "target", draft="")  # (it read "the draft : the checkpoint path")
