"""The compiled decode step's life on disk: compiled once per key, loaded by later engines and processes, a
damaged package compiled again, and a key that changes with everything the compiled code depends on.

(Its arithmetic is tested with the engine's: test_prefix_consistency and test_batch_invariance run compiled
engines at every prefix and alone versus batched.)
"""

import logging

import pytest
import torch
from test_prefix_consistency import (
    FP32_TOL,
    assert_engine_matches_full_forward,
    mixed_requests,
    run_and_record,
)

import generate.compiled as compiled
from conftest import TINY_CONFIGS, make_model
from generate.engine import Engine
from model import KVCache

CONFIG = TINY_CONFIGS["2x2x32"]


def model_and_requests():
    # The model and engine shape of test_prefix_consistency's compiled fp32 test: the same package.
    return make_model(CONFIG, seed=6, std=0.3), mixed_requests(CONFIG, 6, count=5)


def test_a_later_engine_loads_the_package_without_compiling(monkeypatch, caplog):
    model, requests = model_and_requests()
    Engine(model, slots=2, compile=True)  # compiled now, or loaded if an earlier test compiled it
    path = compiled.cache_dir() / "steps" / f"{compiled.step_key(model, KVCache(CONFIG, 2, 64))}.so"
    assert path.is_file()

    def refuse(*args):
        raise AssertionError("compiled again although the package is on disk")

    monkeypatch.setattr(compiled, "_package", refuse)
    with caplog.at_level(logging.INFO, logger="gptgen"):
        engine = Engine(model, slots=2, compile=True)
    assert f"decode step loaded from {path}" in caplog.text
    seen = run_and_record(engine, requests)
    assert_engine_matches_full_forward(model, requests, seen, FP32_TOL)


def test_a_damaged_package_is_compiled_again(monkeypatch, caplog, tmp_path):
    model, requests = model_and_requests()
    Engine(model, slots=2, compile=True)
    name = f"{compiled.step_key(model, KVCache(CONFIG, 2, 64))}.so"
    good = (compiled.cache_dir() / "steps" / name).read_bytes()
    # A fresh directory: the dynamic loader hands a process the library it already loaded from a path
    # again, whatever the file there holds now, so the damaged file must be at a path not loaded before.
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(tmp_path))
    path = tmp_path / "steps" / name
    path.parent.mkdir()
    path.write_bytes(good[: len(good) // 3])  # truncated, as by a full disk or a killed copy: it loads,
    compiled.record_path(path).write_text(f'{{"size": {len(good)}}}')  # then faults; its size tells
    rebuilt = []

    def package(model_, cache_, path_):  # stands in for the minute-long compile: writes a good library
        rebuilt.append(path_)
        path_.write_bytes(good)

    monkeypatch.setattr(compiled, "_package", package)
    with caplog.at_level(logging.INFO, logger="gptgen"):
        engine = Engine(model, slots=2, compile=True)
    assert rebuilt == [path] and "could not load" in caplog.text
    seen = run_and_record(engine, requests)
    assert_engine_matches_full_forward(model, requests, seen, FP32_TOL)


def test_the_key_changes_with_weights_dtype_shape_and_threads(monkeypatch):
    model = make_model(CONFIG, seed=6, std=0.3)
    key = compiled.step_key(model, KVCache(CONFIG, 2, 64))
    assert compiled.step_key(model, KVCache(CONFIG, 2, 64)) == key  # deterministic
    other = make_model(CONFIG, seed=6, std=0.3)
    with torch.no_grad():
        other.h[1].mlp.c_fc.weight[3, 5] += 1e-3
    assert compiled.step_key(other, KVCache(CONFIG, 2, 64)) != key
    assert compiled.step_key(model, KVCache(CONFIG, 4, 64)) != key
    assert compiled.step_key(model, KVCache(CONFIG, 2, 32)) != key
    assert compiled.step_key(model, KVCache(CONFIG, 2, 64, dtype=torch.bfloat16)) != key  # the dtype alone
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert compiled.step_key(make_model(CONFIG, seed=6, std=0.3), KVCache(CONFIG, 2, 64)) != key


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(tmp_path / "mine"))
    assert compiled.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("GPTGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiled.cache_dir() == tmp_path / "xdg" / "gptgen"


def test_jit_step_compiles_once_and_matches_the_full_forward():
    # The torch.compile step (CUDA's; tested here on the CPU): one graph for the engine's whole life. Rows
    # joining, leaving and moving through positions do not recompile it.
    from torch._dynamo.utils import counters

    model, requests = model_and_requests()
    engine = Engine(model, slots=2)
    engine.runner._decode = compiled.jit_step(model, engine.cache)  # compiled here, on a warm-up step
    graphs = counters["stats"]["unique_graphs"]
    seen = run_and_record(engine, requests)
    assert counters["stats"]["unique_graphs"] == graphs
    assert_engine_matches_full_forward(model, requests, seen, FP32_TOL)


def test_an_unwritable_cache_directory_compiles_for_this_process_only(monkeypatch, caplog, tmp_path):
    model, requests = model_and_requests()
    Engine(model, slots=2, compile=True)
    good = compiled.cache_dir() / "steps" / f"{compiled.step_key(model, KVCache(CONFIG, 2, 64))}.so"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(blocker / "cache"))  # a directory that cannot be made

    def package(model_, cache_, path_):  # the real one's first act, then the compile's product
        path_.parent.mkdir(parents=True, exist_ok=True)
        path_.write_bytes(good.read_bytes())

    monkeypatch.setattr(compiled, "_package", package)
    with caplog.at_level(logging.INFO, logger="gptgen"):
        engine = Engine(model, slots=2, compile=True)
    assert "compiling it for this process only" in caplog.text and "GPTGEN_CACHE_DIR" in caplog.text
    assert not (blocker / "cache").exists()
    seen = run_and_record(engine, requests)
    assert_engine_matches_full_forward(model, requests, seen, FP32_TOL)


def test_a_compile_that_would_run_out_of_memory_is_refused_naming_the_figures(monkeypatch, tmp_path):
    import generate.engine

    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(tmp_path))  # nothing on disk: this engine would compile
    monkeypatch.setattr(generate.engine, "available_memory", lambda device: 100 * 2**20)
    model, _ = model_and_requests()
    expected = (
        r"compiling the decode step needs about 0\.5 GiB .* only 0\.1 GiB are available; generate without "
        r"compiling \(compile=False, no --compile\)"
    )
    with pytest.raises(MemoryError, match=expected):
        Engine(model, slots=2, compile=True)
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_step_on_disk_loads_whatever_memory_a_compile_would_need(monkeypatch):
    import generate.engine

    model, requests = model_and_requests()
    Engine(model, slots=2, compile=True)  # on disk now
    monkeypatch.setattr(generate.engine, "available_memory", lambda device: 100 * 2**20)
    seen = run_and_record(Engine(model, slots=2, compile=True), requests)
    assert_engine_matches_full_forward(model, requests, seen, FP32_TOL)


def fake_library(directory, name: str, size: int, age_days: float):
    import os
    import time

    path = directory / f"{name}.so"
    path.write_bytes(b"x" * size)
    compiled.record_path(path).write_text("{}")
    when = time.time() - age_days * 86400
    os.utime(path, (when, when))
    return path


def test_prune_deletes_the_least_recently_used_libraries_down_to_the_limit(tmp_path):
    import os
    import time

    old, older, new, kept = (fake_library(tmp_path, n, 1000, age) for n, age in
                             [("old", 2, ), ("older", 3), ("new", 0.5), ("kept", 9)])  # fmt: skip
    assert new.exists()
    stale, fresh = tmp_path / ".compiling-a", tmp_path / ".compiling-b"
    stale.mkdir()
    (stale / "step.pt2").write_bytes(b"partial")
    fresh.mkdir()
    when = time.time() - 2 * 86400
    os.utime(stale, (when, when))
    deleted = compiled.prune(tmp_path, kept, limit=2500)
    assert deleted == [older, old]  # oldest first; the one just compiled is never deleted, however old
    assert sorted(p.name for p in tmp_path.iterdir()) == [".compiling-b", "kept.record", "kept.so",
                                                         "new.record", "new.so"]  # fmt: skip
    assert compiled.prune(tmp_path, kept, limit=2000) == []  # within the limit: nothing more


def test_the_cache_limit_follows_the_environment_and_refuses_nonsense(monkeypatch):
    monkeypatch.delenv("GPTGEN_CACHE_MAX_GB", raising=False)
    assert compiled.cache_limit_bytes() == 8 * 2**30
    monkeypatch.setenv("GPTGEN_CACHE_MAX_GB", "0.5")
    assert compiled.cache_limit_bytes() == 2**29
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("GPTGEN_CACHE_MAX_GB", bad)
        with pytest.raises(
            ValueError, match=rf"GPTGEN_CACHE_MAX_GB='{bad}' is not a number of GiB; set it to 0"
        ):
            compiled.cache_limit_bytes()


def test_a_compile_prunes_the_cache_to_its_limit_and_keeps_the_new_step(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("GPTGEN_CACHE_MAX_GB", "0")  # keep only what was just compiled
    steps = tmp_path / "steps"
    steps.mkdir()
    stale = fake_library(steps, "stale", 10, 1)
    model, requests = model_and_requests()
    engine = Engine(model, slots=2, compile=True)
    assert not stale.exists() and len(list(steps.glob("*.so"))) == 1
    seen = run_and_record(engine, requests)
    assert_engine_matches_full_forward(model, requests, seen, FP32_TOL)


COMPILE_IN_A_PROCESS = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
import torch
import checkpoints
from generate.engine import Engine
torch.set_num_threads(1)
Engine(checkpoints.load(sys.argv[1]), slots=2, compile=True)
"""


def test_two_processes_wanting_the_same_step_compile_it_once(tmp_path):
    import os
    import subprocess
    import sys

    import checkpoints

    checkpoints.save(make_model(CONFIG, seed=41), tmp_path / "ckpt")  # a step no other test has compiled
    env = {**os.environ, "GPTGEN_CACHE_DIR": str(tmp_path / "cache")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", COMPILE_IN_A_PROCESS, str(tmp_path / "ckpt")],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    logs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    both = "".join(logs)
    assert both.count("decode step compiled in") == 1, both
    assert both.count("another process is compiling this step; waiting for it") == 1, both
    assert both.count("decode step loaded from") == 2, both
    assert len(list((tmp_path / "cache" / "steps").glob("*.so"))) == 1


def test_the_packaged_step_is_compiled_with_frozen_weights(monkeypatch, tmp_path):
    # Inductor freezes (folds the weights in and prepacks them for the GEMM kernels) only with grad off;
    # compiled with grad on, the same settings gave GPT-2 124M bf16 batch-8 steps of 36 ms instead of 19.
    import torch._inductor.freezing as freezing

    frozen = []
    freeze = freezing.freeze
    monkeypatch.setattr(freezing, "freeze", lambda *a, **k: frozen.append(1) or freeze(*a, **k))
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "CPU_OPTIONS", {**compiled.CPU_OPTIONS, "fx_graph_cache": False})
    model, requests = make_model(CONFIG, seed=7, std=0.3), mixed_requests(CONFIG, 7, count=3)
    engine = Engine(model, slots=2, compile=True)
    assert frozen
    seen = run_and_record(engine, requests)
    assert_engine_matches_full_forward(model, requests, seen, FP32_TOL)
