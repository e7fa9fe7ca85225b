"""Speculative decoding: proposals never change an output.

In a speculating engine of several slots the tokens and log-probabilities are those it gives with no
proposals at all, bit for bit, whatever is proposed (always right, always wrong, prompt lookup, a draft
model); against a plain (non-speculating) engine, and in a one-slot engine (which takes plain steps where
nothing is proposed), the tokens are the same and the log-probabilities agree within the prefix tests'
tolerance.
"""

import collections
import dataclasses

import pytest
import torch

import generate
from checkpoints.load import SHIPPED_DIR
from generate.engine.compiled import AVX512
from generate.engine.engine import Engine
from generate.engine.request import Request
from generate.engine.sampling import SamplingParams
from generate.engine.speculate import DraftProposer, NgramProposer, Speculator
from helpers import FP32_TOL, GREEDY, TINY_CONFIGS, NoProposals, make_model
from model import GPT, GPTConfig

CONFIG = TINY_CONFIGS["2x2x32"]  # a 64-position window: many requests run into it
SEEDED = SamplingParams(temperature=0.9, top_p=0.95)


def token_bytes(token: int) -> bytes:
    return bytes([97 + token % 26])  # a letter per token: stop strings over a tiny vocabulary


class Known:
    """Proposes what a run without proposals chose (``shift`` 0: always right; 1: always wrong)."""

    def __init__(self, runs: dict[tuple, list[int]], vocab: int, shift: int) -> None:
        self.runs, self.vocab, self.shift = runs, vocab, shift

    def propose(self, slot, request, k):
        done, full = len(request.token_ids), self.runs[tuple(request.prompt), request.seed]
        return [(t + self.shift) % self.vocab for t in full[done : done + k]]


class Recording:
    """A proposer that keeps what another proposes."""

    def __init__(self, proposer) -> None:
        self.proposer, self.made = proposer, []

    def propose(self, slot, request, k):
        self.made.append(self.proposer.propose(slot, request, k))
        return self.made[-1]


def prompts(count: int, seed: int) -> list[list[int]]:
    """Mixed lengths (1 to 40 of a 64-token window), half of them repeating a phrase (prompt lookup hits)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = int(torch.randint(1, 41, (1,), generator=g))
        if i % 2:
            phrase = torch.randint(
                0, CONFIG.vocab_size, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g
            )
            out.append((phrase.tolist() * 20)[:length])
        else:
            out.append(torch.randint(0, CONFIG.vocab_size, (length,), generator=g).tolist())
    return out


def run(model, prompts, sampling, speculator=None, slots=8, **options):
    engine = Engine(model, slots=slots, speculate=speculator, token_bytes=token_bytes)
    requests = [
        engine.add(
            Request(p, sampling, seed=i, logprobs=True, **{"max_new_tokens": 30, "eos_id": None, **options})
        )
        for i, p in enumerate(prompts)
    ]
    for _ in engine.run():
        pass
    return requests


def results(requests):
    return [(r.token_ids, r.logprobs_list, r.finish_reason) for r in requests]


def assert_same_tokens(a, b):
    """The same tokens and endings, the log-probabilities within the prefix tests' tolerance."""
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        assert max(abs(p - q) for p, q in zip(x.logprobs_list, y.logprobs_list, strict=True)) < 1e-5


@pytest.fixture(scope="module")
def model():
    return make_model(CONFIG, seed=3, std=0.3)


@pytest.fixture(scope="module")
def draft():
    return make_model(CONFIG, seed=4, std=0.3)  # another random model: it disagrees almost always


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("slots", [1, 8])
def test_any_proposals_give_the_tokens_and_logprobs_of_none_bit_for_bit(model, draft, sampling, slots):
    ps, n = prompts(100, seed=slots), 16
    reference = run(model, ps, sampling, Speculator(NoProposals()), slots, max_new_tokens=n)
    runs = {(tuple(r.prompt), r.seed): r.token_ids for r in reference}
    right, wrong = Known(runs, CONFIG.vocab_size, 0), Known(runs, CONFIG.vocab_size, 1)
    proposers = {
        "ngram": NgramProposer(),
        "draft": DraftProposer(draft, slots),
        "right": right,
        "wrong": wrong,
    }
    for name, proposer in proposers.items():
        speculator = Speculator(proposer, lookahead=4)
        spec = run(model, ps, sampling, speculator, slots, max_new_tokens=n)
        if slots > 1:
            assert results(spec) == results(reference), name
        else:  # (plain steps where nothing is proposed: the tokens, and the logprobs within tolerance)
            assert_same_tokens(spec, reference)
        stats = speculator.stats()
        if name == "right":  # every proposal taken: up to 5 tokens a step
            assert stats["acceptance_rate"] == 1.0 and stats["tokens_per_pass"] > 3
        if name == "wrong":  # 4 missed, then one a step while the budget allows (13); alone, one after
            # rests of 1, 2 and 4 tokens (3): a lone slot's step costs more with proposals
            assert stats["accepted"] == 0 and stats["proposed"] == (4 + (3 if slots == 1 else 13)) * len(ps)
        if name == "ngram":
            assert 0 < stats["accepted"] < stats["proposed"]


@pytest.mark.parametrize("slots", [1, 8])
def test_a_draft_samples_at_the_requests_own_numbers_so_a_draft_that_agrees_is_taken(model, slots):
    # The target as its own draft: proposals are its samples at each position (at the request's seed), so
    # almost all are taken; the random model's argmax would match a sample at temperature 0.9 a few times in
    # a hundred. (Not all: a verifying step's logits may differ in the last bits, and a sample near a boundary
    # of the draw with them.)
    ps = prompts(24, seed=7)
    speculator = Speculator(DraftProposer(model, slots), lookahead=4)
    assert_same_tokens(run(model, ps, SEEDED, speculator, slots), run(model, ps, SEEDED, slots=slots))
    assert speculator.stats()["acceptance_rate"] > 0.95


def test_a_compiled_draft_proposes_what_an_eager_one_does_for_every_slot(model, draft):
    # Its one-token steps run its compiled step of all its slots (each other slot fed where it writes next):
    # over 3 slots of interleaved requests, the very proposals of the eager draft, with a draft that agrees
    # (long runs taken: the draft is the target too) and one that disagrees (what a slot holds cut back after
    # each miss). One draft, so one compile.
    ps = prompts(12, seed=9)
    for target in (draft, model):
        proposals, calls = [], collections.Counter()
        for compile in (False, True):
            drafter = DraftProposer(draft, 3, compile=compile)
            if compile:  # (a prefill only for a request's prompt: a pass's catch-up runs the compiled step)
                drafter.runner._steps = counting(drafter.runner._steps, calls)
                drafter.runner.prefill = counting({"prefill": drafter.runner.prefill}, calls)["prefill"]
            recording = Recording(drafter)
            for sampling in (GREEDY, SEEDED):
                speculator = Speculator(recording, lookahead=4)
                plain = run(target, ps, sampling, slots=3)
                assert_same_tokens(run(target, ps, sampling, speculator, 3), plain)
            proposals.append(recording.made)
        assert proposals[0] == proposals[1] and len(proposals[0]) > 100 and calls[1] > 100
        assert calls["prefill"] <= 2 * len(ps)  # (each prompt, greedy and seeded)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculation_gives_a_plain_engines_tokens_and_its_logprobs_within_tolerance(model, sampling):
    ps = prompts(40, seed=5)
    plain = run(model, ps, sampling)
    for proposer in (NgramProposer(), NoProposals()):
        assert_same_tokens(plain, run(model, ps, sampling, Speculator(proposer)))
    # A lone eager slot with nothing to propose takes plain steps: a plain engine's bits.
    alone = [run(model, [p], sampling, Speculator(NoProposals()), slots=1)[0] for p in ps[:8]]
    assert results(alone) == results([run(model, [p], sampling, slots=1)[0] for p in ps[:8]])


def test_a_lone_slot_proposes_for_each_request_afresh(model):
    # A request that ends inside a speculating step leaves no lookahead or rest behind in its slot.
    first, second = prompts(2, seed=9)
    reference = run(model, [first, second], GREEDY, slots=1, max_new_tokens=16)
    right = Known({(tuple(r.prompt), r.seed): r.token_ids for r in reference}, CONFIG.vocab_size, 0)

    def proposed_for_second(after_first: bool) -> int:
        speculator = Speculator(right, lookahead=4)
        engine = Engine(model, slots=1, speculate=speculator)
        if after_first:  # its 4 tokens: 1 from the prompt, then 2 proposed and taken, and 1 in that step
            engine.add(Request(first, GREEDY, max_new_tokens=4, seed=0, eos_id=None))
            for _ in engine.run():
                pass
            assert speculator.counts.passes == 1
        before = speculator.counts.proposed
        request = engine.add(Request(second, GREEDY, max_new_tokens=16, seed=1, eos_id=None))
        for _ in engine.run():
            pass
        assert request.token_ids == reference[1].token_ids
        return speculator.counts.proposed - before

    assert proposed_for_second(after_first=True) == proposed_for_second(after_first=False)


def test_logprobs_equal_the_full_forward_at_every_prefix_to_the_window_end(model):
    ps = prompts(12, seed=6)
    for r in run(model, ps, GREEDY, Speculator(NgramProposer()), max_new_tokens=100):
        assert len(r.prompt) + len(r.token_ids) == CONFIG.n_positions and r.finish_reason == "length"
        ids = torch.tensor([r.prompt + r.token_ids[:-1]])
        with torch.no_grad():
            full = torch.log_softmax(model(ids)[0, len(r.prompt) - 1 :], dim=-1)
        expected = full.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        scale = max(1.0, model(ids).abs().max().item())
        assert (torch.tensor(r.logprobs_list) - expected).abs().max().item() <= 2 * FP32_TOL * scale


@pytest.mark.parametrize("ending", ["eos", "stop", "budget"])
def test_proposals_past_an_eos_a_stop_string_or_the_budget_change_nothing(model, ending):
    ps = prompts(24, seed=7)
    reference = run(model, ps, SEEDED, Speculator(NoProposals()), max_new_tokens=40)
    runs = {(tuple(r.prompt), r.seed): r.token_ids for r in reference}
    # Each request ends early, on a token (or text) from the middle of its free run; the proposals (always
    # right, taken from that free run) go on past it.
    options = {"budget": {"max_new_tokens": 7}, "eos": {"eos_id": reference[0].token_ids[5]},
               "stop": {"stop": (token_bytes(reference[0].token_ids[9]).decode() * 2,)}}[ending]  # fmt: skip
    ended = run(model, ps, SEEDED, Speculator(NoProposals()), **{"max_new_tokens": 40, **options})
    spec = run(
        model, ps, SEEDED, Speculator(Known(runs, CONFIG.vocab_size, 0)), **{"max_new_tokens": 40, **options}
    )
    assert results(spec) == results(ended)
    assert any(len(r.token_ids) < 40 for r in ended)
    if ending == "stop":
        assert all(r.text.text.count(options["stop"][0]) <= 1 for r in spec)


def shipped_prompts(count: int) -> list[str]:
    """``count`` excerpts of the held-out text, 4 to 60 characters, every other one with its first half
    quoted again at its end (prompt lookup's case)."""
    text = (SHIPPED_DIR / "shakespeare" / "heldout.txt").read_text(encoding="utf-8")
    g, out = torch.Generator().manual_seed(11), []
    for i in range(count):
        start, length = int(torch.randint(0, len(text) - 60, (1,), generator=g)), 4 + (i * 37) % 57
        excerpt = text[start : start + length]
        out.append(excerpt + excerpt[: length // 2] if i % 2 else excerpt)
    return out


def test_the_shipped_model_speculating_gives_the_plain_tokens_over_100_prompts():
    # 16 rows through the API against plain decoding: greedy with prompt lookup (often taken), seeded with a
    # random draft sharing the tokenizer (almost never right); then one prompt alone, streamed, both ways.
    plain = generate.load("shakespeare", slots=16)
    config = plain.model.config
    tiny = GPT(GPTConfig(vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=32, n_layer=1,
                         n_head=2)).eval()  # fmt: skip
    ps = shipped_prompts(100)
    seeded = {"temperature": 0.8, "top_p": 0.95, "seed": 3}
    for options, draft in (({"temperature": 0}, "ngram"), (seeded, tiny)):
        a = plain.generate(ps, max_new_tokens=6, logprobs=True, **options)
        gen = generate.Generator(plain.model, slots=16, draft=draft)
        b = gen.generate(ps, max_new_tokens=6, logprobs=True, **options)
        for x, y in zip(a, b, strict=True):
            assert x.token_ids == y.token_ids and x.text == y.text
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-5
        assert gen.speculation["accepted"] > 0 if draft == "ngram" else gen.speculation["proposed"] > 0
        alone = generate.Generator(plain.model, slots=1, draft="ngram")
        text = plain.generate(ps[1], max_new_tokens=16, **options).text
        assert "".join(alone.stream(ps[1], max_new_tokens=16, **options)) == text


class OutOfRange:
    def propose(self, slot, request, k):
        return [0, CONFIG.vocab_size, -1][:k]  # a draft with a larger vocabulary, or a bad proposer


def test_proposals_outside_the_vocabulary_are_cut_and_change_nothing(model):
    ps = prompts(6, seed=9)
    speculator = Speculator(OutOfRange())
    assert results(run(model, ps, SEEDED, speculator)) == results(
        run(model, ps, SEEDED, Speculator(NoProposals()))
    )
    assert speculator.stats()["proposed"] > 0  # (the first, 0, was proposed; the rest cut)


def test_bad_draft_settings_are_refused():
    model = make_model(CONFIG)
    with pytest.raises(ValueError, match=r"draft='bigram': give 'ngram' or a draft model"):
        generate.Generator(model, draft="bigram")
    with pytest.raises(ValueError, match=r"lookahead=0 must be an integer in 1\.\.16"):
        Speculator(NgramProposer(), lookahead=0)
    with pytest.raises(ValueError, match=r"n=0 must be a positive integer"):
        NgramProposer(0)


def test_a_draft_with_a_smaller_vocabulary_is_refused_not_fed_ids_it_lacks():
    model = make_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32))  # GPT-2's vocabulary
    draft = make_model(GPTConfig(vocab_size=300, n_layer=1, n_head=2, n_embd=16, n_positions=32))
    with pytest.raises(ValueError, match=r"the draft's vocabulary has 300 tokens, the model's 50257; give a"):
        generate.Generator(model, draft=draft)
    padded = make_model(GPTConfig(vocab_size=50304, n_layer=1, n_head=2, n_embd=16, n_positions=32))
    out = generate.Generator(padded, draft=model).generate("To be, or not to be", max_new_tokens=5)
    assert len(out.token_ids) == 5  # (a draft of the tokenizer's ids serves a padded vocabulary)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    def propose(history, k=3):
        return NgramProposer(3).propose(0, Request(history, max_new_tokens=99, eos_id=None), k)

    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]) == [7, 1, 2]  # the latest match of the last 3
    assert propose([5, 2, 3, 9, 1, 2, 3]) == [9, 1, 2]  # no earlier [1, 2, 3]: the last 2 tokens' match
    assert propose([4, 8, 6, 6, 1, 8]) == [6, 6, 1]  # no 3- or 2-token match: the last token alone
    assert propose([1, 2, 3, 4]) == []  # nothing matches
    assert propose([7, 7], k=5) == [7]  # the continuation may be short


def counting(steps: dict, calls: collections.Counter) -> dict:
    """A runner's compiled steps (width -> step), each counting its calls in ``calls`` by width."""

    def counted(width, step):
        return lambda *inputs: calls.update([width]) or step(*inputs)

    return {width: counted(width, step) for width, step in steps.items()}


# 10 rows (ATen's GEMMs); a lone slot's 1 to 4 rows (the default lookahead; with AVX-512 the GEMM template's)
# over 2 chunks (a span that varies)
@pytest.mark.parametrize(("slots", "lookahead", "window"), [(2, 4, 64), (1, 3, 128)])
def test_a_compiled_speculative_step_gives_the_tokens_of_none_and_the_eager_ones(slots, lookahead, window):
    # The CPU's AOTInductor library of one step of (slots, 1 + lookahead), compiled once (later engines load
    # it). Several slots: proposals or none, the same bits. A lone slot (with AVX-512): one library of 1 to 4
    # rows, fed its token and what it proposed: the same bits too; past 3 proposals (lookahead 5), padded to
    # a library of 6 rows. Against a plain lone engine (its own one-row library) and eager, the same tokens,
    # logprobs within tolerance.
    model = make_model(dataclasses.replace(CONFIG, n_positions=window), seed=3, std=0.3)
    ps, accepted, calls = prompts(16, seed=8), 0, {name: collections.Counter() for name in ("ngram", "past")}
    ways = {"none": (NoProposals(), lookahead), "ngram": (NgramProposer(), lookahead)}
    if slots == 1:
        ways |= {"plain": (None, 0), "past": (NgramProposer(), 5)}
    for sampling in (GREEDY, SEEDED):
        compiled = {}
        for name, (proposer, ahead) in ways.items():
            speculator = None if proposer is None else Speculator(proposer, ahead)
            engine = Engine(model, slots=slots, speculate=speculator, compile=True)
            if name in calls:
                engine.runner._steps = counting(engine.runner._steps, calls[name])
            options = {"max_new_tokens": 20, "eos_id": None, "logprobs": True}
            requests = [engine.add(Request(p, sampling, seed=i, **options)) for i, p in enumerate(ps)]
            for _ in engine.run():
                pass
            compiled[name] = results(requests)
            accepted += speculator.counts.accepted if name == "ngram" else 0
        for (tokens, logprobs, _), plain in zip(
            compiled["none"], compiled.get("plain", compiled["none"]), strict=True
        ):
            assert tokens == plain[0]
            assert max(abs(x - y) for x, y in zip(logprobs, plain[1], strict=True)) < 1e-5
        if slots > 1 or AVX512:  # one library, whatever the proposals: bit for bit
            assert compiled["ngram"] == compiled["none"]
        eager = run(
            model, ps, sampling, Speculator(NgramProposer(), lookahead), slots=slots, max_new_tokens=20
        )
        for name in ("ngram", "past") if slots == 1 else ("ngram",):
            for (tokens, logprobs, _), r, none in zip(compiled[name], eager, compiled["none"], strict=True):
                assert tokens == r.token_ids == none[0]
                for other in (r.logprobs_list, none[1]):
                    assert max(abs(x - y) for x, y in zip(logprobs, other, strict=True)) < 1e-5
    assert accepted > 10  # (the proposals' path was taken)
    # Several slots: every step at the one width; a lone slot: plain steps where it rests, else its proposals
    lone = set(range(1, 2 + lookahead)) if AVX512 else {1, 1 + lookahead}  # (without: a library each)
    assert set(calls["ngram"]) == (lone if slots == 1 else {1 + lookahead})
    assert calls["ngram"][1 + lookahead] > 10
    if slots == 1:  # past the shared library's widths, padded to its own
        assert {1, 6} <= set(calls["past"]) <= ({1, 2, 3, 4, 6} if AVX512 else {1, 6})
