"""The up-front memory checks see every limit an allocation runs into: the machine's free memory, the
process's address-space limit (ulimit -v) and its container's memory limit (cgroup v1 or v2)."""

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoints
import generate
import generate.engine.memory as memory
import generate.engine.speculate as speculate
from generate.engine.engine import Engine
from helpers import TINY_CONFIGS, make_model
from model import GPTConfig

CPU = torch.device("cpu")


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def test_an_address_space_limit_is_seen(monkeypatch):
    monkeypatch.setattr(memory, "CGROUP_DIR", memory.Path("/nonexistent"))
    limit = _vm_size() + 10 * 2**20
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limit, limit))
    assert memory.available_memory(CPU) <= 10 * 2**20 + 2**20  # (the process may have grown a little)
    # An engine whose cache and working memory exceed it is refused up front, naming the figures.
    model = make_model(TINY_CONFIGS["2x2x32"])
    with pytest.raises(MemoryError, match=r"needs about [\d,]+ MiB .* only [\d,]+ MiB are available"):
        Engine(model, slots=4096)
    # So is a draft's own cache, and a speculating engine before its draft is made (which compiles).
    with pytest.raises(MemoryError, match=r"needs about [\d,]+ MiB .* only [\d,]+ MiB are available"):
        speculate.DraftProposer(model, 4096, compile=True)
    monkeypatch.setattr(speculate, "DraftProposer", lambda *args: pytest.fail("the draft was made first"))
    gen = generate.Generator(model, slots=4096, compile=True, draft=model)
    with pytest.raises(MemoryError, match=r"needs about [\d,]+ MiB .* only [\d,]+ MiB are available"):
        gen.generate(["a"] * 4096, max_new_tokens=2)


@pytest.mark.parametrize(
    ("files", "room"),
    [({"memory.max": "1000000\n", "memory.current": "400000\n"}, 600_000),  # cgroup v2
     ({"memory/memory.limit_in_bytes": "5000000", "memory/memory.usage_in_bytes": "10**6"}, 5_000_000),  # v1,
     ({"memory/memory.limit_in_bytes": "5000000", "memory/memory.usage_in_bytes": "1000000"}, 4_000_000),
     ({"memory.max": "max\n", "memory.current": "400000"}, None),  # v2 without a limit
     ({"memory/memory.limit_in_bytes": str(2**63 - 4096)}, None)],  # v1's "no limit"
)  # fmt: skip
def test_a_container_memory_limit_is_seen(monkeypatch, tmp_path, files, room):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(memory, "CGROUP_DIR", tmp_path)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    assert memory._cgroup_room() == room
    if room is None:  # the machine's free memory alone (it moves a little between readings)
        free = memory.available_memory(CPU)
        assert abs(free - memory._proc_bytes("/proc/meminfo", "MemAvailable:")) < 256 * 2**20
    else:
        assert memory.available_memory(CPU) == room


@pytest.mark.parametrize(
    ("error", "said"),
    [(RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: not enough memory: you "
                   "tried to allocate 16777216 bytes."),
      "out of memory (an allocation of 16 MiB failed); do less"),
     (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                             "79.1 GiB"), "out of memory (an allocation of 2,048 MiB failed); do less"),
     (RuntimeError("DefaultCPUAllocator: not enough memory"), "out of memory; do less")],
    ids=["cpu", "cuda", "no-size"],
)  # fmt: skip
def test_the_allocators_failures_are_said_plainly(error, said):
    assert str(memory.out_of_memory(error, "do less")) == said


@pytest.mark.parametrize("error", [RuntimeError("shape mismatch"), ValueError("alloc_cpu"), MemoryError()])
def test_other_errors_are_not_taken_for_the_allocators(error):
    assert memory.out_of_memory(error, "do less") is None


# A real allocation failure: the child lowers its own address-space limit (ulimit -v) to 300 MB above its size
# and turns off the up-front check, so the allocator itself fails mid-generation.
_OUT_OF_MEMORY = """
import resource, sys
import generate, generate.tools.cli, generate.engine.memory
generate.engine.memory.available_memory = lambda device: None
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + 300 * 2**20, resource.RLIM_INFINITY))
if sys.argv[1] == "cli":
    sys.exit(generate.tools.cli.main(["hi", "-c", sys.argv[2], "--num-samples", "4000", "--batch-size",
                                      "4000", "-n", "3", "--no-stream"]))
try:
    generate.load(sys.argv[2], slots=4000).generate(["hi"] * 4000, max_new_tokens=3)
except MemoryError as e:
    print(f"MemoryError: {e}", file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("how", "said"),
    [("cli", r"generate: error: out of memory \(an allocation of [\d,]+ MiB failed\); use a smaller "
             r"--batch-size or --max-new-tokens, a shorter prompt, or a smaller --dtype"),
     ("api", r"MemoryError: out of memory \(an allocation of [\d,]+ MiB failed\); run fewer requests at "
             r"once, fewer new tokens, a shorter prompt or a smaller dtype")],
)  # fmt: skip
def test_running_out_of_memory_mid_generation_is_said_plainly(tmp_path, how, said):
    checkpoints.save(make_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32)), tmp_path / "m")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    argv = [sys.executable, "-c", _OUT_OF_MEMORY, how, str(tmp_path / "m")]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert proc.stdout == ""
    assert re.fullmatch(said + "\n", proc.stderr), proc.stderr
    assert proc.returncode == (1 if how == "cli" else 0)


def test_a_bare_memory_error_still_says_out_of_memory():
    from generate.tools.cli import error_message

    assert error_message(MemoryError()) == "out of memory"


def test_more_slots_than_a_tensor_can_hold_are_refused_as_too_large():
    model = make_model(TINY_CONFIGS["2x2x32"])
    gen = generate.Generator(model, slots=10**20, deterministic=True)  # (every call: 10**20 rows)
    with pytest.raises(MemoryError, match=r"needs about [\d,]+ MiB \(100000000000000000000 slots x 3 "):
        gen.generate("a", max_new_tokens=2)
