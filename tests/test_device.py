"""The engine's promises on the device the suite is pointed at: ``GPTGEN_TEST_DEVICE`` (default ``cpu``).

CI runs these on the CPU like the rest of the suite; on a machine with a GPU, run them there too:

    GPTGEN_TEST_DEVICE=cuda python -m pytest tests/test_device.py

Each checkpoint is loaded the way users load it (``checkpoints.load(..., device=, dtype=)``), so the
quantized layers are packed for that device. Checked on it: cached generation equals the full forward at every
prefix (fp32 1e-4: a GPU's matrix kernels sum in other orders than a CPU's, still far below a wrong mask's
error; bf16 0.08 as in test_prefix_consistency); a request gives the same bits alone and beside others in an
engine of the same width, in every dtype (``torch.equal``); our fp32 logits equal Hugging Face's within 1e-4;
the API gives the same text alone and in a list with ``deterministic=True``; proposals (prompt lookup, draft
models) change no bit of a speculating engine's output. On CUDA the compiled step (CUDA graphs) is checked the
same way.
"""

from __future__ import annotations

import os

import pytest
import torch

import checkpoints
from generate import Generator, SamplingParams
from generate.engine.engine import Engine
from generate.engine.request import Request
from generate.engine.speculate import DraftProposer, NgramProposer, Speculator
from helpers import (
    BF16_TOL,
    NoProposals,
    assert_engine_matches_full_forward,
    hf_model,
    make_model,
    run_and_record,
)
from model import GPTConfig

DEVICE = torch.device(os.environ.get("GPTGEN_TEST_DEVICE", "cpu"))
CUDA = DEVICE.type == "cuda"
CONFIG = GPTConfig(vocab_size=97, n_positions=192, n_embd=64, n_layer=2, n_head=2)
FP32_DEVICE_TOL = 1e-4
SAMPLED = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.2)
# The CPU's compiled step is checked in test_compiled and test_prefix_consistency; CUDA's here.
COMPILE = [False, True] if CUDA else [False]
INVARIANCE_CASES = [(d, False) for d in ("float32", "bfloat16", "float16", "int8", "int4")]
INVARIANCE_CASES += [(d, True) for d in ("float32", "bfloat16") if CUDA]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("device_ckpt")
    checkpoints.save(make_model(CONFIG, seed=9, std=0.1), directory)
    return directory


def requests(seed: int = 5) -> list[Request]:
    """A long row (past two 64-position chunks) with short ones coming and going; greedy and seeded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (length, budget) in enumerate([(120, 50), (5, 20), (60, 10), (2, 12)]):
        prompt = torch.randint(0, CONFIG.vocab_size, (length,), generator=g).tolist()
        sampling = SamplingParams(temperature=0) if i % 2 else SAMPLED
        out.append(Request(prompt, sampling, max_new_tokens=budget, seed=100 + i, eos_id=None, logprobs=True))
    return out


def engine(model, compile: bool) -> Engine:
    return Engine(model, slots=2, max_len=CONFIG.n_positions, compile=compile)


@pytest.mark.parametrize("compile", COMPILE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_generation_equals_the_full_forward_at_every_prefix(ckpt, dtype, compile):
    model = checkpoints.load(ckpt, device=DEVICE, dtype=dtype)
    rs = requests()
    seen = run_and_record(engine(model, compile), rs)
    assert all(len(r.token_ids) == r.max_new_tokens for r in rs)
    assert_engine_matches_full_forward(model, rs, seen, FP32_DEVICE_TOL if dtype == "float32" else BF16_TOL)


@pytest.mark.parametrize(("dtype", "compile"), INVARIANCE_CASES)
def test_a_request_alone_equals_it_beside_others_bitwise(ckpt, dtype, compile):
    model = checkpoints.load(ckpt, device=DEVICE, dtype=dtype)
    together = requests()
    seen = run_and_record(engine(model, compile), together)
    alone_engine = engine(model, compile)
    for r in together:
        single = Request(r.prompt, r.sampling, r.max_new_tokens, seed=r.seed, eos_id=None, logprobs=True)
        alone = run_and_record(alone_engine, [single])[id(single)]
        assert single.token_ids == r.token_ids and single.logprobs_list == r.logprobs_list, (dtype, r.prompt)
        assert all(torch.equal(a, b) for a, b in zip(alone, seen[id(r)], strict=True)), (dtype, r.prompt)


@pytest.mark.parametrize("compile", COMPILE)
def test_proposals_change_no_bit_of_a_speculating_engines_output(ckpt, compile):
    # Prompt lookup, a draft that mostly disagrees and one that mostly agrees (the model itself, penalties
    # aside; the drafts' steps compiled with the engine's) against no proposals, in engines of one shape:
    # tokens and logprobs bit for bit.
    model = checkpoints.load(ckpt, device=DEVICE)
    other = make_model(CONFIG, seed=4, std=0.1).to(DEVICE)
    outputs, counts = [], []
    drafts = [DraftProposer(other, 2, compile), DraftProposer(model, 2, compile)]
    for proposer in (NoProposals(), NgramProposer(), *drafts):
        speculator, rs = Speculator(proposer, lookahead=3), requests()
        run_and_record(Engine(model, slots=2, compile=compile, speculate=speculator), rs)
        outputs.append([(r.token_ids, r.logprobs_list) for r in rs])
        counts.append(speculator.stats())
    assert all(output == outputs[0] for output in outputs[1:])
    assert counts[0]["proposed"] == 0 and all(c["proposed"] > 0 for c in counts[1:])
    assert counts[3]["acceptance_rate"] > 0.5 and counts[2]["acceptance_rate"] < 0.3  # (CPU: 0.64, 0.01)


def test_fp32_logits_equal_hugging_faces(tmp_path):
    hf = hf_model(seed=2, vocab_size=101, n_positions=64, n_embd=48, n_layer=2, n_head=3)
    hf.save_pretrained(tmp_path)
    ours = checkpoints.load(tmp_path, device=DEVICE)
    ids = torch.randint(0, 101, (3, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf.to(DEVICE)(ids.to(DEVICE)).logits
        actual = ours(ids.to(DEVICE))
    torch.testing.assert_close(actual, expected, atol=FP32_DEVICE_TOL, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_api_gives_the_same_bits_alone_and_in_a_list(text_ckpt, dtype):
    model = checkpoints.load(text_ckpt, device=DEVICE, dtype=dtype)
    gen = Generator(model, slots=4, deterministic=True)
    options = {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "logprobs": True}
    prompts = ["To be", "or not", "that is", "the question"]
    together = gen.generate(prompts, seed=[1, 2, 3, 4], **options)
    for i, prompt in enumerate(prompts):
        alone = gen.generate(prompt, seed=i + 1, **options)
        assert alone.text == together[i].text and alone.logprobs == together[i].logprobs, prompt
