"""Shared helpers for the tests: tiny configurations and models, references, and tiny HF checkpoints (built
and saved here, never downloaded)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers

import checkpoints
from generate.engine.engine import Engine
from generate.engine.request import Request
from generate.engine.sampling import SamplingParams, draw
from model import GPT, GPTConfig, KVCache
from model.int4 import quantize_int4, unpack_codes
from model.quant import quantize_int8

# Tolerances against the full forward (test_prefix_consistency's docstring says why these). fp32's is relative
# to the largest logit's magnitude when that is above 1 (assert_engine_matches_full_forward).
FP32_TOL = 1e-5
BF16_TOL = 0.08
GREEDY = SamplingParams(temperature=0)

# Small but varied shapes: odd head counts, short windows, a non-default MLP width and activation.
TINY_CONFIGS = {
    "2x2x32": GPTConfig(vocab_size=211, n_positions=64, n_embd=32, n_layer=2, n_head=2),
    "5x3x48": GPTConfig(vocab_size=97, n_positions=40, n_embd=48, n_layer=5, n_head=3),
    "1x1x16-relu": GPTConfig(
        vocab_size=50, n_positions=48, n_embd=16, n_layer=1, n_head=1, n_inner=24, activation_function="relu"
    ),
}

# For int4 (its group sizes must divide every linear layer's input width): 64 and 256, a 97-token vocabulary
# (a head padded to 128 rows), and TINY_CONFIGS["5x3x48"]'s vocabulary and window.
INT4_CONFIG = GPTConfig(vocab_size=97, n_positions=40, n_embd=64, n_layer=3, n_head=2)


ROOT = Path(__file__).resolve().parents[1]  # the project


def command_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a command in a subprocess: the project importable, one thread
    (the suite's other worker has the other core)."""
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def make_model(config: GPTConfig, seed: int = 0, std: float = 0.02) -> GPT:
    """A randomly initialised model in eval mode. A larger ``std`` gives clear argmax margins."""
    torch.manual_seed(seed)
    model = GPT(config)
    if std != 0.02:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2 or "ln" not in name:
                    p.normal_(0.0, std)
    return model.eval()


def in_dtype(model: GPT, dtype: str) -> GPT:
    """``model`` in a dtype as ``checkpoints.load`` names it: a torch dtype's name, or "int8", "int8-body",
    "int4", "int4-body" (int4 groups of 32)."""
    if dtype.startswith("int4"):
        return quantize_int4(model, 32, include_head=dtype == "int4")
    if dtype.startswith("int8"):
        return quantize_int8(model, include_head=dtype == "int8")
    return model.to(getattr(torch, dtype))


def greedy_by_recomputation(model: GPT, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: rerun the whole sequence through the uncached forward for every new token."""
    ids = list(prompt)
    with torch.no_grad():
        while len(ids) - len(prompt) < max_new_tokens and len(ids) < model.config.n_positions:
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def cached_logits(
    model: GPT, ids: torch.Tensor, chunks: list[int], max_len: int | None = None
) -> torch.Tensor:
    """Logits for every position of ``ids`` (B, T) computed through a KV cache, ``chunks`` positions at a
    time, every row in its own slot at explicit positions."""
    b, t = ids.shape
    cache = KVCache(model.config, b, max_len or t, dtype=model.compute_dtype)
    out, start = [], 0
    for size in chunks:
        positions = torch.arange(start, start + size).expand(b, -1)
        out.append(model(ids[:, start : start + size], positions=positions, cache=cache))
        start += size
    assert start == t
    return torch.cat(out, dim=1)


def dequantize(codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The fp32 matrix int4 codes stand for, (N, K): the reference the int4 kernels are tested against."""
    q = unpack_codes(codes).float()
    groups = scales_zeros.shape[0]
    s, z = scales_zeros.float().permute(2, 1, 0)  # (N, G) each
    return ((q.view(q.shape[0], groups, -1) - 8) * s[..., None] + z[..., None]).view(q.shape)


def hf_model(seed: int = 0, **config: object) -> transformers.GPT2LMHeadModel:
    """A randomly initialised ``GPT2LMHeadModel`` in eval mode, fp32.

    Every parameter (biases and LayerNorms included) is perturbed away from its init, so a weight that is
    dropped, transposed or misplaced on load changes the logits.
    """
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(bos_token_id=0, eos_token_id=0, **config))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def save_hf(directory: Path, seed: int = 0, **config: object) -> transformers.GPT2LMHeadModel:
    """Build :func:`hf_model` and ``save_pretrained`` it (safetensors) to ``directory``."""
    model = hf_model(seed, **config)
    model.save_pretrained(directory)
    return model


def random_ids(vocab_size: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """(batch, length) token ids drawn with their own generator."""
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def assert_same_logits(ours: GPT, hf: transformers.GPT2LMHeadModel, ids: torch.Tensor, atol: float) -> None:
    """Our logits equal Hugging Face's on ``ids`` within ``atol`` (both in fp32)."""
    expected = hf(ids).logits
    actual = ours(ids)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def tiny_checkpoint(directory: Path) -> tuple[Path, GPT]:
    """A 1-layer checkpoint (vocab 50, width 32) written by our own ``save``; fast, and in the HF layout."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_positions=8, n_embd=32, n_layer=1, n_head=2)).eval()
    return checkpoints.save(model, directory), model


@contextlib.contextmanager
def served_in_process(model: GPT, directory: Path) -> Iterator[object]:
    """A ``TestClient`` of the server's app over ``model`` (saved to ``directory``, one slot), its engine's
    thread running; the engine is stopped and its thread joined after."""
    from starlette.testclient import TestClient

    import generate
    from generate.serving.server import Settings, build_app

    checkpoints.save(model, directory)
    gen = generate.load(directory, slots=1)
    app = build_app(Settings(str(directory)))
    loop = app.state.gptgen.attach(gen, gen.engine(1, model.config.n_positions))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        with TestClient(app) as http:
            yield http
    finally:
        loop.stop(60)
        loop.close()
        thread.join(30)
    assert not thread.is_alive()


class NoProposals:
    """A speculating engine's proposer that never proposes (its steps have the speculating shape)."""

    def propose(self, slot, request, k):
        return []


def run_and_record(engine: Engine, requests: list[Request]) -> dict[int, list[torch.Tensor]]:
    """Run requests through the engine, keeping every logit row it sampled from, per request (a speculating
    engine's: each step's first row a slot)."""
    seen: dict[int, list[torch.Tensor]] = {id(r): [] for r in requests}
    choose = engine._choose

    def spy(logits, rows, *proposals):
        for slot, i in rows.items():
            seen[id(engine.running[slot])].append(logits[i].float().clone())
        return choose(logits, rows, *proposals)

    engine._choose = spy
    for r in requests:
        engine.add(r)
    for _ in engine.run():
        pass
    engine._choose = choose
    return seen


def assert_engine_matches_full_forward(model, requests, seen, tol):
    for r in requests:
        ids = torch.tensor([r.prompt + r.token_ids[:-1]], device=model.device)
        with torch.no_grad():
            full = model(ids)[0, len(r.prompt) - 1 :].float()  # the logits each chosen token came from
        got = torch.stack(seen[id(r)])
        assert got.shape == full.shape
        scale = max(1.0, full.abs().max().item()) if model.compute_dtype == torch.float32 else 1.0
        assert (got - full).abs().max().item() <= tol * scale, r.prompt


def mixed_requests(config, seed, count=6):
    """Requests of varied lengths and budgets: with fewer slots than requests, rows join mid-run."""
    g = torch.Generator().manual_seed(seed)
    n = config.n_positions
    out = []
    for i in range(count):
        length = int(torch.randint(1, n - 12, (1,), generator=g))
        prompt = torch.randint(0, config.vocab_size, (length,), generator=g).tolist()
        out.append(Request(prompt, GREEDY, max_new_tokens=3 + 2 * i, eos_id=None))
    return out


def _candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Reference (sorting, unlike ``sampling.draw``): the tokens one row may draw, (n,) ids (None: every
    token), and their logits shifted (the top one to 0) and divided by the temperature; top-k, then top-p
    over the survivors' softmax, then min-p."""
    # Shift first: a tiny temperature then sends the others to -inf, not inf/inf. Below the dtype's smallest
    # normal number, where the top logit would be 0/0, the limit is taken: the top logits (ties shared) alone.
    top = logits.max()
    if params.temperature < torch.finfo(logits.dtype).tiny:
        ids = (logits == top).nonzero()[:, 0]
        return ids, torch.zeros(len(ids), dtype=logits.dtype, device=logits.device)
    scaled = (logits - top) / params.temperature
    ids = None
    if 0 < params.top_k < len(scaled):
        kth = torch.topk(scaled, params.top_k).values[-1]
        ids = (scaled >= kth).nonzero()[:, 0]  # (ties with the k-th stay)
    kept = scaled if ids is None else scaled[ids]
    if params.top_p < 1.0:  # the fewest most likely (ties: lower ids first) that reach top_p, in id order
        values, order = torch.softmax(kept, dim=-1).sort(descending=True, stable=True)
        inside = (values.cumsum(0) - values) < params.top_p
        inside[0] = True  # (a top_p too tiny for float32 rounds to 0)
        chosen = order[inside].sort().values
        ids, kept = (chosen if ids is None else ids[chosen]), kept[chosen]
    if params.min_p > 0.0:
        probs = torch.softmax(kept, dim=-1)
        chosen = (probs >= params.min_p * probs.max()).nonzero()[:, 0]
        ids, kept = (chosen if ids is None else ids[chosen]), kept[chosen]
    return ids, kept


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Reference: each row's logits shifted (its top one to 0) and divided by the temperature, with the tokens
    top-k, top-p and min-p exclude at ``-inf`` (at least each row's most likely token stays finite)."""
    out = torch.full_like(logits, float("-inf"))
    for row, values in enumerate(logits):
        ids, kept = _candidates(values, params)
        out[row, slice(None) if ids is None else ids] = kept
    return out


def choose(logits: torch.Tensor, params: SamplingParams, uniforms: list[float]) -> torch.Tensor:
    """(B,) int64 tokens: each row of (B, V) processed ``logits`` drawn (``sampling.draw``) at its own uniform
    number (unused when greedy)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    tokens = [draw(row, params, u) for row, u in zip(logits, uniforms, strict=True)]
    return torch.tensor(tokens, device=logits.device)
