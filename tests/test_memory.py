"""The up-front memory checks see every limit an allocation runs into: the machine's free memory, the
process's address-space limit (ulimit -v) and its container's memory limit (cgroup v1 or v2)."""

import resource

import pytest
import torch

import generate.memory as memory
from conftest import TINY_CONFIGS, make_model
from generate.engine import Engine

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
        assert abs(memory.available_memory(CPU) - memory._meminfo_available()) < 256 * 2**20
    else:
        assert memory.available_memory(CPU) == room
