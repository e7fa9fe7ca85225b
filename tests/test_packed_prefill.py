"""Packed prefill: prompts that join in one step are prefilled in one pass (generate/runner.py).

A packed prompt's keys, values and logits equal the reference forward (fp32 within 1e-5) and, where the
check at start found the kernels row-independent at every row count a pass can have, equal the prompt
prefilled alone bitwise. Where the check fails, each prompt is prefilled alone.
"""

import pytest
import torch
from test_batch_invariance import DTYPES, model_in

from conftest import TINY_CONFIGS, make_model
from generate.probes import rows_independent
from generate.runner import PACK_HEAD_ROWS, PACK_ROWS, Runner
from model import KVCache

CONFIG = TINY_CONFIGS["5x3x48"]


def prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def new_runner(model, slots: int) -> Runner:
    cfg = model.config
    return Runner(model, KVCache(cfg, slots, cfg.n_positions, dtype=model.compute_dtype))


def test_packed_prefill_equals_the_reference_forward_at_every_position():
    model = make_model(CONFIG, seed=2, std=0.1)
    cache = KVCache(CONFIG, 4, CONFIG.n_positions)
    ps = prompts([7, 1, 30, 12], CONFIG.vocab_size)
    ids = torch.tensor([t for p in ps for t in p] + [0] * 6)  # six positions of padding
    with torch.inference_mode():
        hidden = model.packed_prefill(ids, cache, [(3, 7), (0, 1), (2, 30), (1, 12)])
        logits = model.wte.project(hidden)
        start = 0
        for p, slot in zip(ps, [3, 0, 2, 1], strict=True):
            full = model(torch.tensor([p]))[0]
            assert (logits[start : start + len(p)] - full).abs().max().item() <= 1e-5
            # the slot holds the prompt's keys, the same as a forward of the prompt alone into a slot
            alone = KVCache(CONFIG, 1, CONFIG.n_positions)
            model(torch.tensor([p]), positions=torch.arange(len(p))[None], cache=alone, slot=0)
            for layer in range(CONFIG.n_layer):
                got = cache.k[layer][slot, :, : len(p)]
                assert (got - alone.k[layer][0, :, : len(p)]).abs().max().item() <= 1e-5
                assert cache.k[layer][slot, :, len(p) :].eq(0).all()  # nothing written past the prompt
            start += len(p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompts_prefilled_together_equal_each_alone_bitwise(dtype):
    model = model_in(dtype)
    ps = prompts([3, 25, 1, 14, 9, 30], model.config.vocab_size, seed=5)
    together = new_runner(model, 6)
    alone = new_runner(model, 6)
    with torch.inference_mode():
        packed = together.prefill_many([(p, slot) for slot, p in enumerate(ps)])
        for slot, p in enumerate(ps):
            (single,) = alone.prefill_many([(p, 5 - slot)])  # alone, in another slot
            assert torch.equal(single, packed[slot]), (together.packs, len(p))
            for layer in range(model.config.n_layer):
                assert torch.equal(alone.cache.k[layer][5 - slot], together.cache.k[layer][slot])
                assert torch.equal(alone.cache.v[layer][5 - slot], together.cache.v[layer][slot])


def test_passes_hold_at_most_the_largest_counts_and_a_long_prompt_runs_alone(monkeypatch):
    config = TINY_CONFIGS["2x2x32"].__class__(vocab_size=50, n_positions=300, n_embd=16, n_layer=1, n_head=2)
    model = make_model(config, seed=1)
    runner = new_runner(model, 20)
    monkeypatch.setattr(Runner, "packs", property(lambda self: True))  # the grouping, whatever the check says
    passes = []
    real = model.packed_prefill
    monkeypatch.setattr(model, "packed_prefill", lambda ids, cache, segs: passes.append((len(ids), segs)) or
                        real(ids, cache, segs))  # fmt: skip
    lengths = [5] * 18 + [200, 60, 270, 3]
    ps = prompts(lengths, config.vocab_size)
    with torch.inference_mode():
        out = runner.prefill_many([(p, i % 20) for i, p in enumerate(ps[:20])])
        assert len(out) == 20
        runner.prefill_many([(p, i) for i, p in enumerate(ps[20:])])
    sizes = [[n for _, n in segs] for _, segs in passes]
    assert sizes == [[5] * 16, [5, 5, 200], [60], [270], [3]]
    assert [rows for rows, _ in passes] == [96, 256, 64, 270, 16]  # padded to PACK_ROWS; 270 alone, as is


class RowCountDependent(torch.nn.Module):
    """A layer whose output depends on how many rows the call has, as a kernel that sums in another order
    for another row count would."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y + 1e-7 * x.reshape(-1, x.shape[-1]).shape[0]


def test_the_check_finds_a_row_count_dependent_layer_and_prefill_then_runs_prompts_alone():
    model = make_model(CONFIG, seed=3)
    model.h[0].ln_1 = RowCountDependent(model.h[0].ln_1)
    assert not rows_independent(model, PACK_ROWS, PACK_HEAD_ROWS)
    runner = new_runner(model, 3)
    assert not runner.packs
    calls = []
    real = runner.prefill
    runner.prefill = lambda p, slot: calls.append(slot) or real(p, slot)
    ps = prompts([4, 9, 2], CONFIG.vocab_size)
    with torch.inference_mode():
        runner.prefill_many([(p, slot) for slot, p in enumerate(ps)])
    assert calls == [0, 1, 2]


@pytest.mark.parametrize(
    "segments",
    [[], [(0, 3), (0, 2)], [(5, 3)], [(0, 0)], [(0, 41)], [(0, 20), (1, 20)]],
    ids=["none", "repeated", "slot", "empty", "too-long", "past-ids"],
)
def test_bad_segments_are_refused(segments):
    model = make_model(CONFIG)
    with pytest.raises(ValueError, match="segments"):
        model.packed_prefill(
            torch.zeros(32, dtype=torch.long), KVCache(CONFIG, 2, CONFIG.n_positions), segments
        )


def test_a_packed_pass_runs_its_head_outside_the_bf16_upcast_mode(monkeypatch, tmp_path):
    # Where bf16 is emulated, the body's products take the upcast mode from its row count and the head's few
    # rows (2-16) never do: with a count among them, a prompt's head would take the route in one pack and not
    # in another. The packing check runs each part under the routes the pass gives it.
    import generate.kernels as kernels
    import generate.runner as runner_module
    from generate.kernels import UpcastBF16

    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runner_module, "upcast_min_rows", lambda model: 4)
    monkeypatch.setattr(runner_module, "_independent", {})
    model = model_in("bfloat16")

    def in_mode() -> bool:
        return any(isinstance(m, UpcastBF16) for m in torch.overrides._get_current_function_mode_stack())

    checked = []
    real_check = runner_module.rows_independent
    monkeypatch.setattr(
        runner_module,
        "rows_independent",
        lambda m, rows, heads: checked.append((rows, heads, in_mode())) or real_check(m, rows, heads),
    )
    runner = new_runner(model, 3)
    assert runner.upcast_rows == 4 and runner.packs
    assert checked == [(PACK_ROWS, (), True), ((), PACK_HEAD_ROWS, False)]
    upcast = []
    real_upcast = kernels._upcast_linear
    monkeypatch.setattr(
        kernels, "_upcast_linear", lambda x, w, b=None: upcast.append(w.shape[0]) or real_upcast(x, w, b)
    )
    ps = prompts([4, 9, 2], CONFIG.vocab_size)  # one pass of 16 rows; a head of 4 rows, at the count of 4
    with torch.inference_mode():
        packed = runner.prefill_many([(p, slot) for slot, p in enumerate(ps)])
    assert upcast and CONFIG.vocab_size not in upcast  # the body upcast, the head not
    with torch.inference_mode():
        alone = [runner.prefill_many([(p, 0)])[0] for p in ps]  # heads of 2 rows
    assert all(torch.equal(a, b) for a, b in zip(packed, alone, strict=True))
