"""`gptgen batch --ray` on a real Ray cluster: two nodes faked by `ray.cluster_utils.Cluster` (two logical
CPUs each), two workers. The cluster runs in a helper process and every job is the command in its own
process, as a user runs it, so no Ray driver lives in the test process (Ray ends a driver whose raylet or
GCS it loses with a bare exit; here that fails one test with its output instead of ending the session).
The Ray output equals the local output row for row (seeded and greedy rows), a failed row loses no other,
Parquet works, a second run skips the rows already written, and the command prints one line, its result
or its error, whatever Ray logs."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

import generate
from generate.tools.batch import Defaults, run_file
from helpers import ROOT, command_env

ROWS = [{"prompt": f"Row {i} of the batch:", "id": i, "seed": 100 + i, "temperature": 0.9} for i in range(12)]
ROWS += [
    {"prompt": "Greedy, please", "id": 12, "seed": None, "temperature": 0.0},
    {"prompt": "This row fails", "id": 13, "seed": None, "temperature": -1.0},
]
OPTIONS = ["-n", "8", "--batch-size", "4"]
CLUSTER = """
import sys
from ray.cluster_utils import Cluster
nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
nodes.add_node(num_cpus=2)
nodes.wait_for_nodes()
print(nodes.address, flush=True)
sys.stdin.read()  # until the tests close it (or end)
nodes.shutdown()
"""
WROTE = r"wrote \S+: {ran} rows \({skipped} already there\) in [\d.]+ s on Ray \([\d.,]+ rows/s\)\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> str:
    """A head node and a second node, two logical CPUs each (one for a worker, one for Ray Data's read and
    write tasks), started once for the module in a helper process; its address."""
    log = tmp_path_factory.mktemp("ray_cluster") / "cluster.log"
    with open(log, "w") as err:
        pipe = subprocess.PIPE
        proc = subprocess.Popen(
            [sys.executable, "-c", CLUSTER], stdin=pipe, stdout=pipe, stderr=err, text=True
        )
    ready, _, _ = select.select([proc.stdout], [], [], 180)
    address = proc.stdout.readline().strip() if ready else ""
    if not address:
        proc.kill()
        proc.wait()
        pytest.fail(f"the Ray cluster did not start: {log.read_text()[-3000:]}")
    yield address
    proc.stdin.close()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def ckpt(text_ckpt):
    return text_ckpt


def read_parts(folder) -> list[dict]:
    """Every row of Ray's part files (JSON Lines), by id."""
    lines = [line for part in sorted(folder.glob("*.json*")) for line in part.read_text().splitlines()]
    rows = [json.loads(line) for line in lines]
    return sorted(rows, key=lambda r: r["id"])


def gptgen_batch(*args) -> subprocess.CompletedProcess:
    """``gptgen batch ARGS`` in its own process (no terminal, so no progress bar)."""
    env = command_env()
    command = [sys.executable, "-m", "generate.tools.gptgen", "batch", *map(str, args)]
    options = {"stdin": subprocess.DEVNULL, "capture_output": True, "text": True, "timeout": 600}
    return subprocess.run(command, cwd=ROOT, env=env, **options)


def test_the_ray_output_equals_the_local_output_row_for_row(cluster, ckpt, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    local = tmp_path / "local.jsonl"
    run_file(generate.load(ckpt), source, local, Defaults(max_new_tokens=8), slots=4)
    out = tmp_path / "ray_out"
    ray_options = ["--ray", cluster, "--workers", "2", "--cpus-per-worker", "1"]
    argv = [source, out, "-c", ckpt, *OPTIONS, *ray_options]
    done = gptgen_batch(*argv)
    # Exit 0 and one line: Ray's logs (progress, the actors' warnings) stay in its log files.
    assert done.returncode == 0 and done.stdout == "", done.stderr[-3000:]
    assert re.fullmatch(WROTE.format(ran=14, skipped=0), done.stderr), done.stderr[-3000:]
    expected = [json.loads(line) for line in local.read_text().splitlines()]
    got = read_parts(out)
    assert got == expected  # every field of every row, results included
    assert got[13]["finish_reason"] == "error" and "temperature=-1.0 is out of range" in got[13]["error"]
    assert all(r["error"] is None and r["token_ids"] for r in got[:13])
    # Run again: every row is already there, nothing is added.
    parts = sorted(p.name for p in out.iterdir())
    again = gptgen_batch(*argv)
    assert again.returncode == 0 and re.fullmatch(WROTE.format(ran=0, skipped=14), again.stderr), again.stderr
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
    done = gptgen_batch(tmp_path / "in.parquet", out, "-c", ckpt, *OPTIONS, "--ray", cluster)
    assert done.returncode == 0 and re.fullmatch(WROTE.format(ran=12, skipped=0), done.stderr), done.stderr
    got = sorted(pq.read_table(out).to_pylist(), key=lambda r: r["id"])
    assert got == pq.read_table(local).to_pylist()


@pytest.mark.parametrize(
    ("options", "match"),
    [(["--cpus-per-worker", "3"], r"--cpus-per-worker 3 is more than any node .* has \(at most 2\)"),
     (["--workers", "4"], r"4 workers x 1 CPUs and one CPU .* need 5 CPUs, but the cluster has 4"),
     (["-c", "/nonexistent/ck"],
      r"a Ray worker failed: .*checkpoint path /nonexistent/ck does not exist \(Ray's logs: (\S+)\)$")],
)  # fmt: skip
def test_a_job_the_cluster_cannot_run_is_one_line_of_error(cluster, ckpt, tmp_path, options, match):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
    done = gptgen_batch(source, tmp_path / "out", "-c", ckpt, *OPTIONS, "--ray", cluster, *options)
    # Exit 1 and one line, though a worker's failure makes Ray print tracebacks from the driver and the
    # cluster (some on standard output) and its core worker log an error from C++.
    assert done.returncode == 1 and done.stdout == "", done.stdout[-3000:]
    err = done.stderr
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    found = re.search(match, err.strip())
    assert found and err.startswith("gptgen batch: error: "), err
    if found.groups():  # the logs named are there (the cluster runs on this machine)
        assert Path(found.group(1)).is_dir()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, r"input \S+in\.jsonl does not exist; give an existing file$"),
     ('{"prompt": "a"}\n{oops\n',
      r"a Ray worker failed: \S*JSONDecodeError: Extra data: line 2 column 1 .* \(Ray's logs: \S+\)$")],
)  # fmt: skip
def test_an_input_ray_cannot_read_is_one_line_saying_why(cluster, ckpt, tmp_path, content, match):
    source = tmp_path / "in.jsonl"
    if content is not None:
        source.write_text(content)
    done = gptgen_batch(source, tmp_path / "out", "-c", ckpt, *OPTIONS, "--ray", cluster)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr[-3000:]
    assert re.search(match, done.stderr.strip()), done.stderr
    assert not (tmp_path / "out").exists()


def test_an_output_folder_holding_the_input_is_refused_not_read_as_done(ckpt, tmp_path):
    source = tmp_path / "data" / "in.jsonl"
    source.parent.mkdir()
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    for out in (source.parent, tmp_path):  # (its rows would be read as the output's: nothing to run)
        done = gptgen_batch(source, out, "-c", ckpt, *OPTIONS, "--ray")
        assert done.returncode == 1, done.stderr[-3000:]
        assert re.fullmatch(r"gptgen batch: error: the output folder \S+ holds the input \S+in\.jsonl; give "
                            r"another folder\n", done.stderr), done.stderr  # fmt: skip
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["data", "in.jsonl"]


def test_progress_counts_the_rows_in_new_part_files_only(tmp_path):
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from generate.tools.ray_batch import _rows_in, _watching

    (tmp_path / "old.json").write_text('{"id": 0}\n' * 5)  # a part file of an earlier run
    seen = []
    with _watching(tmp_path, "json", 7, lambda done, total: seen.append((done, total))):
        (tmp_path / "a.json").write_text('{"id": 1}\n{"id": 2}\n')
        time.sleep(1.3)
        (tmp_path / "b.json").write_text('{"id": 3}\n' * 9)  # more than the total: shown as the total
        time.sleep(1.3)
    assert seen[0] == (2, 7) and seen[-1] == (7, 7) and all(total == 7 for _, total in seen)
    pq.write_table(pa.Table.from_pylist([{"id": i} for i in range(6)]), tmp_path / "c.parquet")
    (tmp_path / "d.parquet").write_bytes(b"PAR1 half written")
    assert _rows_in(tmp_path / "c.parquet", "parquet") == 6
    assert _rows_in(tmp_path / "d.parquet", "parquet") == 0 and _rows_in(tmp_path / "gone", "json") == 0


def test_only_the_yielded_stream_reaches_the_console_while_ray_runs(capfd):
    from generate.tools.ray_batch import console_to_null

    print("before", file=sys.stderr)
    with console_to_null() as stderr:
        os.write(1, b"C++ on stdout\n")
        os.write(2, b"C++ on stderr\n")
        print("Python on stdout")
        print("Python on stderr", file=sys.stderr)
        print("ours", file=stderr)
    print("after", file=sys.stderr)
    out, err = capfd.readouterr()
    assert out == "" and err == "before\nours\nafter\n"


@pytest.mark.parametrize("closed", [1, 2])
def test_a_closed_standard_stream_stays_closed_and_takes_nothing(closed):
    # A command run with 1>&- (or 2>&-): that fd is /dev/null during the job (Ray may write there) and closed
    # again after, and none of the descriptors the redirect holds takes its number meanwhile.
    code = (
        "import os, sys\n"
        f"os.close({closed})\n"
        "from generate.tools.ray_batch import console_to_null\n"
        "with console_to_null() as err:\n"
        "    os.write(1, b'C++ on stdout')\n"
        "    os.write(2, b'C++ on stderr')\n"
        "    print('ours', file=err)\n"
        "try:\n"
        f"    os.fstat({closed})\n"
        "except OSError:\n"
        "    sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "", done.stderr
    assert done.stderr == ("ours\n" if closed == 1 else "")  # with stderr closed, ours goes nowhere
