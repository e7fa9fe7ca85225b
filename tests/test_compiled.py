"""The compiled decode step's life on disk: compiled once per key (checkpoint, dtype, width), reporting its
progress, loaded by later engines, a damaged library compiled again, and a key that changes with everything
the compiled code depends on.

(Its arithmetic is tested with the engine's: test_prefix_consistency runs compiled engines over a whole
window, alone and beside others, in fp32 and bf16.)
"""

import dataclasses
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

import checkpoints
import generate.engine.compiled as compiled
import generate.engine.store as store
from generate.api import Generator
from generate.engine.engine import Engine
from generate.engine.request import Request
from generate.engine.runner import Runner
from generate.engine.sampling import SamplingParams
from helpers import (
    FP32_TOL,
    INT4_CONFIG,
    ROOT,
    TINY_CONFIGS,
    assert_engine_matches_full_forward,
    command_env,
    in_dtype,
    make_model,
    mixed_requests,
    run_and_record,
)
from model import GPTConfig, KVCache

CONFIG = TINY_CONFIGS["2x2x32"]


def test_one_compile_serves_every_engine_of_its_width_and_a_damaged_library_is_compiled_again(
    monkeypatch, caplog
):
    # A window of 100 positions: not whole chunks (the cache holds 128, the step reads one or two chunks).
    config = GPTConfig(vocab_size=211, n_positions=100, n_embd=32, n_layer=2, n_head=2)
    model, requests = make_model(config, seed=6, std=0.3), mixed_requests(config, 6, count=5)
    assert max(len(r.prompt) + r.max_new_tokens for r in requests) > 64
    path = store.cache_dir() / "steps" / f"{compiled.step_key(model, KVCache(config, 2, 100))}.so"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a library")  # damaged, as by a full disk or a foreign file
    lines: list[str] = []
    with caplog.at_level(logging.INFO, logger="gptgen"):
        engine = Engine(model, slots=2, max_len=20, compile=True, progress=lines.append)
    assert "could not load" in caplog.text and "compiling it again" in caplog.text
    assert lines[0].startswith("compiling the decode step (2 rows x 100 positions")
    assert lines[-1].startswith("decode step compiled in")
    assert engine.cache.max_len == config.n_positions  # the whole window, whatever max_len asked
    assert path.stat().st_size > 10_000
    # The tokens come embedded: the library holds the head's weights, not a plain copy of the embedding table.
    constants = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1).get_constant_names_to_original_fqns()
    assert "model.ln_f.weight" in constants.values() and "model.wte.weight" not in constants.values()

    def refuse(*args):
        raise AssertionError("compiled again although the library is on disk")

    monkeypatch.setattr(compiled, "_package", refuse)
    for _ in range(2):  # later engines of this width load it, whatever their lengths
        engine = Engine(model, slots=2, max_len=40, compile=True)
        seen = run_and_record(engine, requests)
        assert_engine_matches_full_forward(model, requests, seen, FP32_TOL)
        # The library's own pages of the weights, copied by its runner at load, are no longer resident.
        assert constants_resident_kib(path) <= 8


def test_eager_generation_writes_nothing_and_compiled_writes_only_its_step(text_ckpt, tmp_path):
    # As a user runs it: the command, with a home, a temporary directory and a working directory of its own
    # and no cache settings. Inductor's own files (kernels, the library before packaging) are made in the
    # compile's working directory and deleted with it; importing torch's compiler makes an empty directory
    # where inductor's cache goes by default.
    home = tmp_path / "home"
    (home / "tmp").mkdir(parents=True)
    unset = ("GPTGEN_", "TORCHINDUCTOR_", "TRITON_", "XDG_", "TORCH_HOME", "HF_")
    env = command_env({k: v for k, v in os.environ.items() if not k.startswith(unset)})
    env |= {"HOME": str(home), "TMPDIR": str(home / "tmp"), "PYTHONDONTWRITEBYTECODE": "1"}
    steps, default = Path(".cache/gptgen/steps"), Path("tmp", Path(default_cache_dir()).name)
    for options, written, folders in [
        ([], set(), {Path("tmp")}),
        (["--compile"], {".so", ".lock"}, {Path("tmp"), default, Path(".cache"), steps.parent, steps}),
    ]:
        command = [sys.executable, "-m", "generate", "To be", "-c", str(text_ckpt), "-n", "3", *options]
        done = subprocess.run(command, cwd=home, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout, done.stderr
        paths = {p.relative_to(home) for p in home.rglob("*")}
        files = {p for p in paths if (home / p).is_file()}
        assert len(files) == len(written) and {p.suffix for p in files} == written, paths
        assert all(p.parent == steps for p in files) and paths - files <= folders, paths


def test_a_lone_unquantized_step_is_given_the_models_own_weights_not_a_copy(text_ckpt):
    # A step of one row of an unquantized model: its library holds no weights and reads the model's tensors
    # themselves (a process holds them once): a weight changed in place changes its logits as it does eager's.
    # Only over weights laid out plainly, as checkpoints.load(..., plain=True) leaves them (generate.load's
    # when compiling); its default layouts for eager products get a library's prepacked copy.
    cache = KVCache(CONFIG, 1, CONFIG.n_positions)
    for plain in (True, False):
        loaded = checkpoints.load(text_ckpt, plain=plain)
        assert all(t.is_contiguous() for t in loaded.state_dict().values()) == plain
        assert (compiled.own_weights(loaded, cache, (1,)) is not None) == plain
    model = make_model(CONFIG, seed=8, std=0.3)
    runner = Runner(model, KVCache(CONFIG, 1, CONFIG.n_positions), compile=True)
    eager = Runner(model, KVCache(CONFIG, 1, CONFIG.n_positions))

    def step() -> list[torch.Tensor]:
        with torch.inference_mode():
            for r in (runner, eager):
                r.prefill([3, 1, 4], 0)
            return [r.decode(torch.tensor([5]), torch.tensor([3])) for r in (runner, eager)]

    before, _ = step()
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight.mul_(-1)
    after, reference = step()
    assert not torch.equal(after, before)
    assert (after - reference).abs().max() <= FP32_TOL * reference.abs().max()
    (library,) = (store.cache_dir() / "steps").glob("*.so")
    names = torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1).get_constant_names_to_original_fqns()
    assert "model.h.0.mlp.c_fc.weight" in names.values()
    start, end = store.constants_span(library)
    assert end - start <= 8  # (no weights inside: the library's section of them is empty)
    # A call beside a busy kept engine of a Generator gets an engine of its own: the same library, loaded.
    gen = Generator(model, compile=True)
    kept = gen.engine(1, CONFIG.n_positions)
    requests = [Request([3, 1, 4], SamplingParams(temperature=0), 6, eos_id=None) for _ in range(2)]
    kept.add(requests[0])
    kept.step()
    other = gen.engine(1, CONFIG.n_positions)
    assert other is not kept and gen._engine is kept
    other.add(requests[1])
    for engine in (other, kept):
        while engine.has_work:
            engine.step()
    assert requests[0].token_ids == requests[1].token_ids and len(list(library.parent.glob("*.so"))) == 1
    model.h[0].mlp.c_fc.weight.data = model.h[0].mlp.c_fc.weight.data.clone()  # (as model.to() does)
    with pytest.raises(RuntimeError, match="the model's weights moved"):
        step()


def test_a_library_given_the_models_weights_serves_another_checkpoint_of_the_same_shapes(monkeypatch):
    # Its key leaves the weights' values out (it holds none): another model of the same shapes, every tensor
    # different, runs on it without a compile and gets its own logits; one holding its weights is per model.
    # One of the first model's weights all one value: folded into the library, it would be kept too.
    model, other = make_model(CONFIG, seed=8, std=0.3), make_model(CONFIG, seed=9, std=0.3)
    with torch.no_grad():
        model.h[0].mlp.c_proj.weight.fill_(0.01)
        for p in other.parameters():  # (the layer norms' too)
            p.add_(torch.rand_like(p))
    pairs = zip(model.state_dict().values(), other.state_dict().values(), strict=True)
    assert all(not torch.equal(a, b) for a, b in pairs)
    lone, two = KVCache(CONFIG, 1, CONFIG.n_positions), KVCache(CONFIG, 2, CONFIG.n_positions)
    assert compiled.step_key(model, lone) == compiled.step_key(other, lone)
    assert compiled.step_key(model, two) != compiled.step_key(other, two)
    Runner(model, lone, compile=True)
    monkeypatch.setattr(compiled, "_package", lambda *args: pytest.fail("compiled again"))
    runners = [Runner(other, KVCache(CONFIG, 1, CONFIG.n_positions), compile=c) for c in (True, False)]
    with torch.inference_mode():
        for r in runners:
            r.prefill([3, 1, 4], 0)
        got, reference = (r.decode(torch.tensor([5]), torch.tensor([3])) for r in runners)
    assert (got - reference).abs().max() <= FP32_TOL * reference.abs().max()


def constants_resident_kib(path) -> int:
    """KiB resident of the mapping holding a loaded library's weights (its ``.lrodata``), after checking
    that the weights take more than a few pages (so a resident copy would show)."""
    start, end = store.constants_span(path)
    assert end - start > 64 * 1024
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        span = re.fullmatch(r"([0-9a-f]+)-([0-9a-f]+)", line.split()[0])
        if span and int(span[1], 16) <= start < int(span[2], 16):
            return next(int(x.split()[1]) for x in lines[i + 1 :] if x.startswith("Rss:"))
    raise AssertionError("the library's weights are not mapped")


def test_the_key_changes_with_weights_dtype_width_and_threads(monkeypatch):
    model = make_model(CONFIG, seed=5)
    key = compiled.step_key(model, KVCache(CONFIG, 2, 64))
    assert compiled.step_key(model, KVCache(CONFIG, 2, 64)) == key  # deterministic
    other = make_model(CONFIG, seed=5)
    with torch.no_grad():
        other.h[0].mlp.c_fc.bias[0] += 1e-3
    assert compiled.step_key(other, KVCache(CONFIG, 2, 64)) != key
    assert compiled.step_key(model, KVCache(CONFIG, 4, 64)) != key
    assert compiled.step_key(model, KVCache(CONFIG, 2, 64), (1, 4)) != key  # a width
    assert compiled.step_key(model, KVCache(CONFIG, 2, 64, dtype=torch.bfloat16)) != key  # the dtype alone
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert compiled.step_key(model, KVCache(CONFIG, 2, 64)) != key


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(tmp_path / "mine"))
    assert store.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("GPTGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert store.cache_dir() == tmp_path / "xdg" / "gptgen"


def fake_package(calls: list[int]):
    """A stand-in for the compile: counts its calls and leaves a file where the library goes."""

    def package(model, cache, path, progress, width):
        path.parent.mkdir(parents=True, exist_ok=True)  # (the real one's first act)
        calls.append(1)
        path.write_bytes(b"library")

    return package


def test_two_engines_wanting_the_same_step_at_once_compile_it_once(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(compiled, "_package", fake_package(calls))
    monkeypatch.setattr(store, "load", lambda path, _: (lambda *inputs: None) if path.exists() else None)
    model = make_model(CONFIG, seed=7)
    threads = [threading.Thread(target=compiled.packaged_step, args=(model, KVCache(CONFIG, 2, 64)))
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1]


def test_an_unwritable_cache_directory_compiles_for_this_process_only(monkeypatch, caplog, tmp_path):
    calls: list[int] = []
    monkeypatch.setattr(compiled, "_package", fake_package(calls))
    monkeypatch.setattr(store, "load", lambda path, _: (lambda *inputs: None) if path.exists() else None)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GPTGEN_CACHE_DIR", str(blocker / "cache"))  # a directory that cannot be made
    with caplog.at_level(logging.INFO, logger="gptgen"):
        compiled.packaged_step(make_model(CONFIG, seed=8), KVCache(CONFIG, 2, 64))
    assert "compiling it for this process only" in caplog.text and "GPTGEN_CACHE_DIR" in caplog.text
    assert calls == [1] and not (blocker / "cache").exists()


def test_a_compile_that_would_run_out_of_memory_is_refused_naming_the_figures(monkeypatch):
    import generate.engine.memory

    monkeypatch.setattr(generate.engine.memory, "available_memory", lambda device: 100 * 2**20)
    expected = (
        r"compiling the decode step needs about 0\.5 GiB .* only 0\.1 GiB are available; generate without "
        r"compiling \(compile=False, no --compile\)"
    )
    with pytest.raises(MemoryError, match=expected):
        Engine(make_model(CONFIG, seed=6), slots=2, compile=True)
    assert not (store.cache_dir() / "steps").exists()  # nothing written


def test_compiling_on_a_torch_older_than_2_13_is_refused_naming_the_version_and_the_fix(monkeypatch):
    from torch.torch_version import TorchVersion

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.12.1+cu130"))  # (its int4 step fails to build)
    expected = r"needs torch 2\.13 or newer, not 2\.12\.1\+cu130: pip install torch==2\.13\.0, or generate"
    with pytest.raises(RuntimeError, match=expected):
        Engine(make_model(CONFIG, seed=6), slots=2, compile=True)
    assert not (store.cache_dir() / "steps").exists()  # nothing written


def test_prune_deletes_the_least_recently_used_libraries_down_to_the_limit(tmp_path):
    import os
    import time

    paths = []
    for i, age in enumerate([3, 1, 2, 0]):
        path = tmp_path / f"{i}.so"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (time.time() - age * 86400,) * 2)
        paths.append(path)
    kept = paths[0]  # the oldest, but the one just compiled
    deleted = store.prune(tmp_path, kept, limit=2500)
    assert deleted == [paths[2], paths[1]]  # 4,000 bytes: two go (never the kept one) to reach 2,000
    assert sorted(tmp_path.glob("*.so")) == [paths[0], paths[3]]
    assert store.prune(tmp_path, kept, limit=2000) == []  # within the limit: nothing more


def test_a_killed_compiles_working_folder_goes_at_the_next_prune_unless_its_key_is_locked(tmp_path):
    # A compile killed midway: its working folder (inductor's files, soon as large as the weights) stays.
    # The next prune deletes it, but not while a compile of its key (here: this test) holds the key's lock.
    import fcntl
    import time

    code = ("from helpers import TINY_CONFIGS, make_model; from generate.engine.engine import Engine; "
            "Engine(make_model(TINY_CONFIGS['2x2x32']), slots=1, compile=True)")  # fmt: skip
    env = command_env() | {"GPTGEN_CACHE_DIR": str(tmp_path)}
    compiling = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT / "tests", env=env, stderr=subprocess.DEVNULL
    )
    steps, deadline = tmp_path / "steps", time.monotonic() + 120
    while not list(steps.glob(".compiling-*/*")) and compiling.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    compiling.kill()
    compiling.wait()
    (work,) = steps.glob(".compiling-*")
    (lock,) = steps.glob("*.lock")
    assert work.name.startswith(f".compiling-{lock.stem}-") and not list(steps.glob("*.so"))
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert store.prune(steps, steps / "none.so", limit=0) == [] and work.is_dir()  # its compile runs
    store.prune(steps, steps / "none.so", limit=0)
    assert not work.exists() and lock.exists()


def test_the_cache_limit_follows_the_environment_and_refuses_nonsense(monkeypatch):
    monkeypatch.delenv("GPTGEN_CACHE_MAX_GB", raising=False)
    assert store.cache_limit_bytes() == 8 * 2**30
    monkeypatch.setenv("GPTGEN_CACHE_MAX_GB", "0.5")
    assert store.cache_limit_bytes() == 2**29
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("GPTGEN_CACHE_MAX_GB", bad)
        with pytest.raises(ValueError, match=r"GPTGEN_CACHE_MAX_GB=.* is not a number of GiB"):
            store.cache_limit_bytes()


def test_jit_step_compiles_once_and_matches_the_full_forward(monkeypatch):
    # The torch.compile step (CUDA's; tested here on the CPU): one graph for the engine's whole life. Rows
    # joining, leaving and moving through positions do not recompile it, nor does another engine of its shape;
    # engines of other shapes never count against its recompile limit (a process of many engines).
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    monkeypatch.setattr(compiled, "CODES", {})  # (no shape seen before)
    model, requests = make_model(CONFIG, seed=6, std=0.3), mixed_requests(CONFIG, 6, count=5)
    compiled.jit_step(model, KVCache(model.config, 1, 64), width=2)  # another engine's step, first
    engine = Engine(model, slots=2)
    step, calls = compiled.jit_step(model, engine.cache), []  # compiled here, on a warm-up step
    engine.runner.compiled, engine.runner._steps = True, {1: lambda *inputs: calls.append(1) or step(*inputs)}
    graphs = counters["stats"]["unique_graphs"]
    compiled.jit_step(model, KVCache(model.config, 2, engine.cache.max_len))  # (its graph, reused)
    seen = run_and_record(engine, requests)
    assert counters["stats"]["unique_graphs"] == graphs and len(calls) > 10  # (its steps ran it)
    assert_engine_matches_full_forward(model, requests, seen, FP32_TOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4"])
def test_a_lone_slots_steps_of_1_to_4_tokens_give_each_token_its_own_steps_bits(dtype):
    # With AVX-512 a lone slot's steps of 1 to 4 tokens are one library (dynamic width, the GEMM template's
    # rows): each row of a wider step has the bits of that token's own step, and agrees with eager's.
    # (fp32 and whole generations: tests/test_speculate.py's compiled test.)
    config = dataclasses.replace(INT4_CONFIG, n_layer=1)  # (one layer: a shorter compile)
    model = in_dtype(make_model(config, seed=4, std=0.3), dtype)
    cache = KVCache(model.config, 1, model.config.n_positions, dtype=model.compute_dtype)
    runner = Runner(model, cache, compile=True, widths=(1, 4))
    assert len({id(step) for step in runner._steps.values()}) == (1 if compiled.AVX512 else 2)
    assert runner.fits(3) == compiled.AVX512
    prompt = torch.randint(0, INT4_CONFIG.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    eager = Runner(model, KVCache(model.config, 1, model.config.n_positions, dtype=model.compute_dtype))
    with torch.inference_mode():
        for r in (runner, eager):
            r.prefill(prompt.tolist(), 0)
        tokens, positions = torch.tensor([[5, 9, 2, 7]]), torch.arange(20, 24)[None]
        wide = runner.verify(tokens, positions)  # (1, 4, V)
        for j in range(4):  # token j alone, after tokens 0..j-1 (written again, the same bits)
            alone = runner.decode(tokens[:, j], positions[:, j])
            if compiled.AVX512:  # (without, a library each)
                assert torch.equal(alone, wide[:, j])
            reference = eager.decode(tokens[:, j], positions[:, j])
            assert (alone.float() - reference.float()).abs().max() <= 0.08 * reference.float().abs().max()
