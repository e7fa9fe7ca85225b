"""Eager route decisions are measured once per machine and kept (generate/routes.py)."""

import json

import pytest
import torch

import generate.runner
from conftest import TINY_CONFIGS, make_model
from generate.routes import model_facts, recorded
from generate.runner import Runner
from model import KVCache
from model.embedding import TiedEmbedding

CONFIG = TINY_CONFIGS["5x3x48"]


@pytest.fixture
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(tmp_path))
    return tmp_path


def counting(value):
    calls = []

    def measure():
        calls.append(1)
        return value

    return measure, calls


def test_a_decision_is_measured_once_and_then_read_back(cache_dir):
    measure, calls = counting(7)
    assert recorded("x", {"a": 1}, measure, valid=lambda v: type(v) is int) == 7
    assert recorded("x", {"a": 1}, measure, valid=lambda v: type(v) is int) == 7
    assert len(calls) == 1 and len(json.loads((cache_dir / "routes.json").read_text())) == 1
    other, other_calls = counting(False)
    assert recorded("x", {"a": 2}, other) is False  # other facts: measured on their own
    assert recorded("y", {"a": 1}, other) is False  # another decision
    assert len(other_calls) == 2 and len(json.loads((cache_dir / "routes.json").read_text())) == 3


def test_the_thread_count_is_part_of_the_key(cache_dir):
    measure, calls = counting(True)
    before = torch.get_num_threads()
    try:
        recorded("x", {}, measure)
        torch.set_num_threads(before + 1)
        recorded("x", {}, measure)
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 2


def test_a_kept_answer_of_the_wrong_kind_is_measured_again(cache_dir):
    measure, calls = counting(True)
    recorded("x", {}, measure)
    path = cache_dir / "routes.json"
    path.write_text(json.dumps({key: "yes" for key in json.loads(path.read_text())}))  # edited by hand
    assert recorded("x", {}, measure) is True and len(calls) == 2
    assert list(json.loads(path.read_text()).values()) == [True]


def test_a_damaged_file_is_measured_again_and_rewritten(cache_dir):
    (cache_dir / "routes.json").write_text("{not json")
    measure, calls = counting(True)
    assert recorded("x", {}, measure) is True and recorded("x", {}, measure) is True
    assert len(calls) == 1 and list(json.loads((cache_dir / "routes.json").read_text()).values()) == [True]


def test_an_unwritable_cache_directory_measures_every_time(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(blocker / "cache"))
    measure, calls = counting(True)
    assert recorded("x", {}, measure) is True and recorded("x", {}, measure) is True
    assert len(calls) == 2 and not (blocker / "cache").exists()


def test_a_second_runner_takes_the_kept_routes_without_measuring(cache_dir, monkeypatch):
    model = make_model(CONFIG, seed=2)
    monkeypatch.setattr(generate.runner, "_independent", {})  # none known in this process yet
    first = Runner(model, KVCache(CONFIG, 2, CONFIG.n_positions))
    first_packs = first.packs
    measured = []
    monkeypatch.setattr(generate.runner, "onednn_pays", lambda *a: measured.append(a) or True)
    monkeypatch.setattr(generate.runner, "upcast_min_rows", lambda *a: measured.append(a) or 4)
    monkeypatch.setattr(generate.runner, "rows_independent", lambda *a: measured.append(a) or False)
    monkeypatch.setattr(generate.runner, "_independent", {})  # as in a new process
    second = Runner(model, KVCache(CONFIG, 2, CONFIG.n_positions))
    assert measured == [] and second.packs == first_packs
    assert (second.onednn, second.onednn_prefill, second.upcast_rows) == (
        first.onednn,
        first.onednn_prefill,
        first.upcast_rows,
    )
    monkeypatch.setattr(generate.runner, "head_blocks_pays", lambda *a: measured.append(a) or None)
    Runner(model, KVCache(CONFIG, 3, CONFIG.n_positions))  # another slot count: the decode routes measured
    assert [a[1] for a in measured] == [3, 3], [a[1:] for a in measured]  # oneDNN, then the head's blocks


def test_decode_steps_take_upcast_blocks_only_where_they_fit_and_steps_were_faster(cache_dir, monkeypatch):
    # One block per thread, in the pieces measured fastest; whole steps timed (held to 3%) only where there is
    # a piece size for the model and the bf16 products take the blocks in its pieces.
    model = make_model(CONFIG, seed=2).to(torch.bfloat16)
    monkeypatch.setattr(generate.runner.torch, "get_num_threads", lambda: 2)
    sizes = {1: None, 2: 2000, 3: 3000, 4: 4000}  # slots -> the piece size measured fastest
    monkeypatch.setattr(generate.runner, "upcast_pieces_fastest", lambda model, rows, blocks: sizes[rows])
    fitted = []
    monkeypatch.setattr(  # the blocks fit at 3 rows and more, in the pieces measured for them
        generate.runner,
        "upcast_blocks_fit",
        lambda model, rows, blocks, piece_bytes: fitted.append((rows, piece_bytes)) or rows > 2,
    )
    timed = steps_faster_at(monkeypatch, slots=3)
    runners = {n: Runner(model, KVCache(CONFIG, n, 16, dtype=torch.bfloat16)) for n in (1, 2, 3, 4)}
    assert {n: (r.upcast_pieces, r.upcast_blocks) for n, r in runners.items()} == {
        1: (None, None),
        2: (2000, None),
        3: (3000, 2),
        4: (4000, None),
    }
    assert fitted == [(2, 2000), (3, 3000), (4, 4000)]  # (none at 1 slot: no piece size)
    assert timed == [("upcast_blocks", 2, None, 0.97, 3), ("upcast_blocks", 2, None, 0.97, 4)]
    again = Runner(model, KVCache(CONFIG, 3, 16, dtype=torch.bfloat16))  # kept: nothing measured again
    assert (again.upcast_pieces, again.upcast_blocks) == (3000, 2) and len(timed) == 2 and len(fitted) == 3
    assert again._decode_model().wte.pieces.nbytes == 3000  # the step's copy takes the measured pieces


@pytest.mark.parametrize(("off", "on", "blocks"), [(2.0, 1.0, 2), (1.0, 1.0, None), (1.0, 0.98, None)])
def test_timing_whole_steps_leaves_the_route_as_the_clock_says(cache_dir, monkeypatch, off, on, blocks):
    from generate.kernels import UpcastBF16, _UpcastTiedEmbedding

    runner = Runner(
        make_model(CONFIG, seed=2).to(torch.bfloat16), KVCache(CONFIG, 3, 16, dtype=torch.bfloat16)
    )
    runner.upcast_rows, runner.upcast_blocks, runner.upcast_pieces = 2, None, 4 * 48 * 10
    heads, project = [], _UpcastTiedEmbedding.project
    monkeypatch.setattr(_UpcastTiedEmbedding, "project", lambda self, x: heads.append(1) or project(self, x))
    entered, enter = [], UpcastBF16.__enter__
    monkeypatch.setattr(UpcastBF16, "__enter__", lambda self: entered.append(1) or enter(self))
    ticks = iter([0.0, off, 10.0, 10.0 + on] * 3)  # each round: a step off, then a step on
    monkeypatch.setattr(generate.runner.time, "perf_counter", lambda: next(ticks))
    assert runner._steps_faster_with("upcast_blocks", 2, None) is (blocks is not None)
    assert runner.upcast_blocks == blocks and len(heads) == 3  # the three steps timed on the route
    assert not entered  # a decode step never enters the prefill's mode
    assert list(runner._routed) == ([(False, None, None, 2, 4 * 48 * 10)] if blocks else [])


def steps_faster_at(monkeypatch, slots: int) -> list[tuple]:
    """Whole steps timed (``Runner._steps_faster_with``) come out faster on the route at ``slots`` slots
    only; returns the list each timing's arguments go into."""
    timed = []

    def steps_faster(self, route, on=True, off=False, by=0.97):
        timed.append((route, on, off, by, self.cache.slots))
        faster = self.cache.slots == slots
        setattr(self, route, on if faster else off)
        return faster

    monkeypatch.setattr(Runner, "_steps_faster_with", steps_faster)
    return timed


def test_the_head_takes_row_blocks_only_where_whole_steps_were_faster(cache_dir, monkeypatch):
    # The head's block count comes from the head alone; then whole steps are timed both ways, and kept.
    model = make_model(CONFIG, seed=2)
    monkeypatch.setattr(generate.runner, "onednn_pays", lambda model, rows: False)
    monkeypatch.setattr(generate.runner, "head_blocks_pays", lambda m, rows, onednn: 4 if rows > 1 else None)
    timed = steps_faster_at(monkeypatch, slots=3)
    made = {n: Runner(model, KVCache(CONFIG, n, 16)).head_blocks for n in (1, 2, 3)}
    assert made == {1: None, 2: None, 3: 4}
    assert timed == [("head_blocks", 4, None, 1.0, 2), ("head_blocks", 4, None, 1.0, 3)]  # not at 1 row
    assert Runner(model, KVCache(CONFIG, 3, 16)).head_blocks == 4 and len(timed) == 2  # kept


@pytest.mark.parametrize(("off", "on", "blocks"), [(1.0, 0.98, 4), (1.0, 1.0, None), (1.0, 1.02, None)])
def test_timing_the_head_in_row_blocks_leaves_it_as_the_clock_says(cache_dir, monkeypatch, off, on, blocks):
    # The head alone was faster in blocks; whole steps need only be no slower (the gain is within their
    # noise), and they are timed on the route's copy of the modules, kept only if it wins.
    from generate.kernels import _BlockedTiedEmbedding

    runner = Runner(make_model(CONFIG, seed=2), KVCache(CONFIG, 3, 16))
    runner.onednn, runner.head_blocks, runner.body_blocks = False, None, None
    monkeypatch.setattr(generate.runner, "head_blocks_pays", lambda model, rows, onednn: 4)
    heads, project = [], _BlockedTiedEmbedding.project
    monkeypatch.setattr(_BlockedTiedEmbedding, "project", lambda self, x: heads.append(1) or project(self, x))
    ticks = iter([0.0, off, 10.0, 10.0 + on] * 3)  # each round: a step off, then a step on
    monkeypatch.setattr(generate.runner.time, "perf_counter", lambda: next(ticks))
    assert runner._measure_head_blocks() == blocks
    assert runner.head_blocks == blocks and len(heads) == 3  # the three steps timed in blocks
    kept = [(False, 4, None, None, None)] if blocks else []
    assert list(runner._routed) == kept  # a loser's copy is dropped
    assert type(runner._decode_model().wte) is (_BlockedTiedEmbedding if blocks else TiedEmbedding)


def test_the_body_takes_row_blocks_only_where_they_fit_and_whole_steps_were_faster(cache_dir, monkeypatch):
    # One block per thread; whole steps timed (held to 3%) only where the layers take the blocks.
    model = make_model(CONFIG, seed=2)
    monkeypatch.setattr(generate.runner, "onednn_pays", lambda model, rows: False)
    monkeypatch.setattr(generate.runner, "head_blocks_pays", lambda model, rows, onednn: None)
    monkeypatch.setattr(generate.runner.torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(generate.runner, "body_blocks_fit", lambda model, rows, blocks: rows > 1)
    timed = steps_faster_at(monkeypatch, slots=3)
    made = {n: Runner(model, KVCache(CONFIG, n, 16)).body_blocks for n in (1, 2, 3)}
    assert made == {1: None, 2: None, 3: 2}
    assert timed == [("body_blocks", 2, None, 0.97, 2), ("body_blocks", 2, None, 0.97, 3)]
    runner = Runner(model, KVCache(CONFIG, 3, 16))
    assert runner.body_blocks == 2 and len(timed) == 2  # kept
    assert type(runner._decode_model().h[0].mlp.c_fc).__name__ == "_BlockedLinearModule"


def test_model_facts_tell_layer_kinds_sizes_and_dtypes_apart():
    model = make_model(CONFIG)
    facts = model_facts(model)
    assert model_facts(make_model(CONFIG, seed=5)) == facts  # weights do not matter
    assert model_facts(make_model(TINY_CONFIGS["2x2x32"])) != facts
    assert model_facts(make_model(CONFIG).to(torch.bfloat16)) != facts
    model.h[0].ln_1 = torch.nn.Sequential(model.h[0].ln_1)
    assert model_facts(model) != facts
