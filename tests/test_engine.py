"""The decode loop: greedy generation against full recomputation and against Hugging Face generate()."""

import pytest
import torch
import transformers

import checkpoints
from generate import GenerationError, SamplingParams, generate_ids
from helpers import TINY_CONFIGS, greedy_by_recomputation, make_model

GREEDY = SamplingParams(temperature=0)


def random_prompts(vocab, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("seed", [0, 1])
def test_cached_greedy_equals_recomputed_greedy_batched(tiny_config, seed):
    model = make_model(tiny_config, seed=seed, std=0.3)  # clear argmax margins
    prompts = random_prompts(tiny_config.vocab_size, [1, 17, 6], seed)
    out = generate_ids(model, prompts, max_new_tokens=12, sampling=GREEDY, eos_id=None)
    for p, row in zip(prompts, out, strict=True):
        assert row.token_ids == greedy_by_recomputation(model, p, 12)
        assert row.finish_reason == "length"


def test_rows_reaching_the_window_end_in_a_padded_batch_match_alone():
    # The longest row fills the window first; shorter rows keep going (the cache drops shared padding).
    config = TINY_CONFIGS["2x2x32"]
    model = make_model(config, seed=7, std=0.3)
    prompts = random_prompts(config.vocab_size, [20, 2, 9], 7)
    out = generate_ids(model, prompts, max_new_tokens=100, sampling=GREEDY, eos_id=None)
    for p, row in zip(prompts, out, strict=True):
        assert len(p) + len(row.token_ids) == config.n_positions
        assert row.finish_reason == "length"
        assert row.token_ids == greedy_by_recomputation(model, p, 100)


def test_greedy_equals_transformers_generate_with_left_padding(tmp_path):
    config = TINY_CONFIGS["5x3x48"]
    model = make_model(config, seed=11, std=0.3)
    checkpoints.save(model, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    prompts = random_prompts(config.vocab_size, [3, 12, 1, 7], 11)
    ours = generate_ids(model, prompts, max_new_tokens=10, sampling=GREEDY, eos_id=None)
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        theirs = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    for i, row in enumerate(ours):
        assert row.token_ids == theirs[i, longest:].tolist(), i


def test_eos_stops_a_row_and_it_stops_changing():
    config = TINY_CONFIGS["2x2x32"]
    model = make_model(config, seed=2, std=0.3)
    prompts = random_prompts(config.vocab_size, [4, 4], 2)
    free = generate_ids(model, prompts, max_new_tokens=8, sampling=GREEDY, eos_id=None)
    tokens = free[0].token_ids
    k = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])  # row 0's first new token
    eos = tokens[k]  # treat it as end-of-text
    out = generate_ids(model, prompts, max_new_tokens=8, sampling=GREEDY, eos_id=eos)
    assert out[0].token_ids == tokens[: k + 1] and out[0].finish_reason == "stop"
    first = free[1].token_ids.index(eos) + 1 if eos in free[1].token_ids else 8
    assert out[1].token_ids == free[1].token_ids[:first]


def test_seeded_sampling_row_alone_equals_row_in_batch():
    config = TINY_CONFIGS["2x2x32"]
    model = make_model(config, seed=3, std=0.3)
    prompts = random_prompts(config.vocab_size, [5, 1, 25], 3)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    batch = generate_ids(model, prompts, max_new_tokens=15, sampling=params, seed=42, eos_id=None)
    for p, row in zip(prompts, batch, strict=True):
        assert generate_ids(model, [p], max_new_tokens=15, sampling=params, seed=42, eos_id=None)[0] == row


def test_greedy_rows_with_and_without_penalties_in_one_engine_each_choose_their_own_way():
    # Plain greedy rows take an argmax made for all rows at once; a penalized greedy row beside them
    # applies its penalties first. Checked against recomputation, the penalty applied by hand.
    from generate.engine.engine import Engine
    from generate.engine.request import Request
    from generate.engine.sampling import apply_penalties

    config = TINY_CONFIGS["2x2x32"]
    model = make_model(config, seed=4, std=0.3)
    plain, shy = random_prompts(config.vocab_size, [4, 7], 4)
    penalized = SamplingParams(temperature=0, presence_penalty=2.0, repetition_penalty=1.5)
    engine = Engine(model, slots=2)
    rows = [
        engine.add(Request(plain, GREEDY, 10, eos_id=None)),
        engine.add(Request(shy, penalized, 10, eos_id=None)),
    ]
    for _ in engine.run():
        pass
    assert rows[0].token_ids == greedy_by_recomputation(model, plain, 10)
    ids = list(shy)
    seen, counts = (
        torch.zeros(config.vocab_size, dtype=torch.bool),
        torch.zeros(config.vocab_size, dtype=torch.int32),
    )
    seen[ids] = True
    for _ in range(10):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, -1:]
        token = int(apply_penalties(logits, seen[None], counts[None], penalized).argmax())
        seen[token], counts[token] = True, counts[token] + 1
        ids.append(token)
    assert rows[1].token_ids == ids[len(shy) :]
    assert rows[1].token_ids != greedy_by_recomputation(model, shy, 10)  # the penalties changed something


def test_nan_logits_are_reported_not_sampled():
    config = TINY_CONFIGS["2x2x32"]
    model = make_model(config, seed=1)
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight[0, 0] = float("nan")  # a corrupted weight
    with pytest.raises(GenerationError, match="NaN or infinite logits"):
        generate_ids(model, [[1, 2, 3]], max_new_tokens=3, sampling=GREEDY)


@pytest.mark.parametrize(
    ("prompts", "max_new", "match"),
    [
        ([[1] * 64], 5, "prompt 0: the prompt has 64 tokens but the model's window is 64 positions"),
        ([[1], []], 5, "prompt 1: the prompt has no tokens"),
        ([[1, 500]], 5, r"token id 500 outside the vocabulary 0\.\.210"),
        ([[1]], -1, "max_new_tokens must be an integer >= 0, got -1"),
        ([], 5, "no prompts given"),
    ],
)
def test_bad_requests(prompts, max_new, match):
    model = make_model(TINY_CONFIGS["2x2x32"])
    with pytest.raises(ValueError, match=match):
        generate_ids(model, prompts, max_new_tokens=max_new, sampling=GREEDY)


def test_infinite_logits_are_reported_not_sampled():
    model = make_model(TINY_CONFIGS["2x2x32"], seed=1)
    with torch.no_grad():
        model.ln_f.weight.zero_()  # the final hidden state is ln_f.bias, whose product with one token's
        model.ln_f.bias.fill_(3e38)  # (tied) embedding overflows fp32: finite weights, an infinite logit
        model.wte.weight[5] = 10.0
    with pytest.raises(GenerationError, match="NaN or infinite logits"):
        generate_ids(model, [[1, 2, 3]], max_new_tokens=3, sampling=SamplingParams(temperature=0.7), seed=0)


def test_huge_finite_logits_whose_sum_overflows_are_sampled_not_refused():
    # The finiteness check sums a row first: 3e38 + 3e38 is inf in fp32, yet every logit is finite.
    from generate.engine.engine import Engine
    from generate.engine.request import Request

    config = TINY_CONFIGS["2x2x32"]
    engine = Engine(make_model(config, seed=1), slots=1)
    huge = torch.zeros(config.vocab_size)
    huge[7], huge[9] = 3e38, 3.2e38
    engine.runner.prefill = lambda tokens, slot, start: huge.clone()
    engine.runner.decode = lambda tokens, positions: huge[None].clone()
    request = engine.add(Request([1, 2], GREEDY, 3, eos_id=None))
    for _ in engine.run():
        pass
    assert request.token_ids == [9, 9, 9] and request.finish_reason == "length"


@pytest.mark.parametrize(
    ("seed", "shown"), [(-1, "-1"), (2**64, str(2**64)), (1.5, "1.5"), ("7", "'7'"), (True, "True")]
)
def test_bad_seeds_are_refused_naming_the_value(seed, shown):
    model = make_model(TINY_CONFIGS["2x2x32"])
    with pytest.raises(
        ValueError, match=rf"seed={shown} is out of range; a seed must be an integer in 0\.\.2"
    ):
        generate_ids(model, [[1, 2]], max_new_tokens=2, seed=seed)


def test_numpy_integers_are_accepted_as_seeds_and_sizes():
    np = pytest.importorskip("numpy")
    model = make_model(TINY_CONFIGS["2x2x32"], seed=0, std=0.3)
    a = generate_ids(model, [[1, 2]], max_new_tokens=np.int64(4), seed=np.int64(3),
                     sampling=SamplingParams(top_k=np.int64(5)))  # fmt: skip
    b = generate_ids(model, [[1, 2]], max_new_tokens=4, seed=3, sampling=SamplingParams(top_k=5))
    assert a[0].token_ids == b[0].token_ids and len(a[0].token_ids) == 4
    # Prompts as a 2-D array or tensor, or a list of rows of either (a 2-D one was numpy's or torch's
    # "truth value ... ambiguous" error); floats in one are refused as a list's are.
    for prompts in (np.array([[1, 2]]), torch.tensor([[1, 2]]), [np.array([1, 2])], [torch.tensor([1, 2])]):
        c = generate_ids(model, prompts, max_new_tokens=4, seed=3, sampling=SamplingParams(top_k=5))
        assert c[0].token_ids == b[0].token_ids
    with pytest.raises(ValueError, match=r"the prompt has token id 1\.0, which is not an integer"):
        generate_ids(model, np.array([[1.0, 2.0]]), max_new_tokens=4)


def model_with_nan_at_position(position):
    """A model whose position embedding at ``position`` is NaN: only a sequence reaching it is hit."""
    model = make_model(TINY_CONFIGS["2x2x32"], seed=5, std=0.3)
    with torch.no_grad():
        model.wpe.weight[position, 0] = float("nan")
    return model


def test_a_non_finite_request_ends_with_error_and_the_others_go_on():
    from generate.engine.engine import Engine
    from generate.engine.request import Request

    model = model_with_nan_at_position(10)
    seeded = SamplingParams(temperature=1.0, top_k=30)
    in_decode, sampled, in_prefill, after = random_prompts(211, [8, 3, 12, 4], 5)
    requests = [
        Request(in_decode, GREEDY, 6, eos_id=None),  # reaches position 10 at its fourth token
        Request(sampled, seeded, 6, seed=9, eos_id=None),  # positions 0..8 only
        Request(in_prefill, GREEDY, 6, eos_id=None),  # its prompt covers position 10
        Request(after, GREEDY, 6, eos_id=None),  # joins a slot a failed request left
    ]
    engine = Engine(model, slots=2)
    for r in requests:
        engine.add(r)
    events = [e for step in engine.run() for e in step]
    hit, ok, hit_at_once, later = requests
    assert (hit.finish_reason, hit_at_once.finish_reason) == ("error", "error")
    assert "NaN or infinite logits" in hit.error and hit.error == hit_at_once.error
    assert hit.token_ids == greedy_by_recomputation(model, in_decode, 3)  # the three before position 10
    assert hit_at_once.token_ids == []
    assert [t for r, t in events if r is hit] == hit.token_ids  # no event for the failed step
    alone = generate_ids(model, [sampled], max_new_tokens=6, sampling=seeded, seed=9, eos_id=None)[0]
    assert (ok.token_ids, ok.finish_reason, ok.error) == (alone.token_ids, "length", None)
    assert later.token_ids == greedy_by_recomputation(model, after, 6) and later.finish_reason == "length"
    assert later.error is None and not engine.has_work
    engine.add(hit)  # a request run again starts clean
    assert (hit.error, hit.finish_reason, hit.token_ids) == (None, None, [])


def test_a_request_whose_sampling_fails_ends_alone_with_an_error():
    from generate.engine.engine import Engine, raise_errors
    from generate.engine.request import Request

    model = make_model(TINY_CONFIGS["2x2x32"], seed=1)
    broken = {7}

    def token_bytes(token: int) -> bytes:  # a tokenizer that fails on one request's prompt token
        if token in broken:
            raise KeyError(token)
        return b"x"

    engine = Engine(model, slots=2, token_bytes=token_bytes)
    ok, bad = Request([1, 2, 3], GREEDY, 6, eos_id=None), Request([4, 5], GREEDY, 6, eos_id=None)
    alone = generate_ids(model, [[1, 2, 3]], max_new_tokens=6, sampling=GREEDY, eos_id=None)[0]
    first = greedy_by_recomputation(model, [4, 5], 1)
    broken.add(first[0])  # its first token cannot be spelled
    engine.add(ok)
    engine.add(bad)
    for _ in engine.run():
        pass
    assert (bad.finish_reason, bad.token_ids) == ("error", first)  # chosen, then its text failed
    assert "could not be chosen: KeyError" in bad.error
    assert ok.token_ids == alone.token_ids and ok.error is None
    with pytest.raises(GenerationError, match="KeyError"):
        raise_errors([ok, bad])


@pytest.mark.parametrize(("slots", "chunks"), [(1, [(0, 50)]), (2, [(0, 32), (32, 50)])])
def test_a_lone_slot_prefills_its_prompt_in_one_pass_several_slots_in_chunks(monkeypatch, slots, chunks):
    # With neighbours a step prefills at most PREFILL_CHUNK positions (cut at its multiples); a lone slot
    # stalls no one, so its prompt goes in one pass. Either way greedy equals recomputation.
    from generate.engine.engine import Engine
    from generate.engine.request import Request

    config = TINY_CONFIGS["2x2x32"]
    model, seen = make_model(config, seed=3, std=0.3), []
    engine = Engine(model, slots=slots)
    prefill = engine.runner.prefill

    def recorded(tokens, slot, start=0):
        seen.append((start, start + len(tokens)))
        return prefill(tokens, slot, start)

    monkeypatch.setattr(engine.runner, "prefill", recorded)
    prompt = random_prompts(config.vocab_size, [50], 3)[0]
    request = engine.add(Request(prompt, GREEDY, 8, eos_id=None))
    for _ in engine.run():
        pass
    assert seen == chunks
    assert request.token_ids == greedy_by_recomputation(model, prompt, 8)
