"""`gptgen batch --ray` on a real Ray cluster: two nodes faked by `ray.cluster_utils.Cluster` (one CPU each),
two workers. The Ray output equals the local output row for row (seeded and greedy rows), a failed row
loses no other, Parquet works, and a second run skips the rows already written."""

from __future__ import annotations

import json
import re

import pytest
import ray
from ray.cluster_utils import Cluster

import generate
from generate.batch import Defaults, run_file
from generate.tools import batch_main

ROWS = [{"prompt": f"Row {i} of the batch:", "id": i, "seed": 100 + i, "temperature": 0.9} for i in range(12)]
ROWS += [
    {"prompt": "Greedy, please", "id": 12, "seed": None, "temperature": 0.0},
    {"prompt": "This row fails", "id": 13, "seed": None, "temperature": -1.0},
]
OPTIONS = ["-n", "8", "--batch-size", "4"]


@pytest.fixture(scope="module")
def cluster():
    """A head node and a second node, two logical CPUs each (one for a worker, one for Ray Data's read and
    write tasks): started once for the module."""
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    nodes.add_node(num_cpus=2)
    nodes.wait_for_nodes()
    yield nodes
    if ray.is_initialized():
        ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="module")
def ckpt(text_ckpt):
    return text_ckpt


def read_parts(folder) -> list[dict]:
    """Every row of Ray's part files (JSON Lines), by id."""
    lines = [line for part in sorted(folder.glob("*.json*")) for line in part.read_text().splitlines()]
    rows = [json.loads(line) for line in lines]
    return sorted(rows, key=lambda r: r["id"])


def run(argv) -> int:
    try:
        return batch_main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


def test_the_ray_output_equals_the_local_output_row_for_row(cluster, ckpt, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    local = tmp_path / "local.jsonl"
    run_file(generate.load(ckpt), source, local, Defaults(max_new_tokens=8), slots=4)
    out = tmp_path / "ray_out"
    ray_options = ["--ray", cluster.address, "--workers", "2", "--cpus-per-worker", "1"]
    argv = [source, out, "-c", ckpt, *OPTIONS, *ray_options]
    assert run(argv) == 0
    expected = [json.loads(line) for line in local.read_text().splitlines()]
    got = read_parts(out)
    assert got == expected  # every field of every row, results included
    assert got[13]["finish_reason"] == "error" and "temperature=-1.0 is out of range" in got[13]["error"]
    assert all(r["error"] is None and r["token_ids"] for r in got[:13])
    # Run again: every row is already there, nothing is added.
    parts = sorted(p.name for p in out.iterdir())
    assert run(argv) == 0
    assert read_parts(out) == expected
    assert len(parts) <= len(list(out.iterdir()))


def test_parquet_on_ray_equals_parquet_locally(cluster, ckpt, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{k: v for k, v in r.items() if k != "seed"} | {"seed": 100 + r["id"]} for r in ROWS[:12]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    local = tmp_path / "local.parquet"
    run_file(generate.load(ckpt), tmp_path / "in.parquet", local, Defaults(max_new_tokens=8), slots=4)
    out = tmp_path / "ray_out"
    argv = [tmp_path / "in.parquet", out, "-c", ckpt, *OPTIONS, "--ray", cluster.address, "--workers", "2"]
    assert run(argv) == 0
    got = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["id"])
    assert got == pq.read_table(local).to_pylist()


@pytest.mark.parametrize(
    ("options", "match"),
    [(["--cpus-per-worker", "3"], r"--cpus-per-worker 3 is more than any node .* has \(at most 2\)"),
     (["--workers", "4"], r"4 workers x 1 CPUs and one CPU .* need 5 CPUs, but the cluster has 4"),
     (["-c", "/nonexistent/ck"], r"a Ray worker failed: .*checkpoint path /nonexistent/ck does not exist")],
)  # fmt: skip
def test_a_job_the_cluster_cannot_run_is_one_line_of_error(cluster, ckpt, tmp_path, capsys, options, match):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    argv = [source, tmp_path / "out", "-c", ckpt, *OPTIONS, "--ray", cluster.address, *options]
    assert run(argv) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(match, err), err
    assert not (tmp_path / "out").exists()
