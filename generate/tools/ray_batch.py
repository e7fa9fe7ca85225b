"""``gptgen batch --ray``: the same job on a Ray cluster, with Ray Data.

``read_json`` / ``read_parquet`` -> ``map_batches`` with :class:`BatchWorker`, a callable class (each actor
loads the model once and runs its batches on its own engine) -> ``write_json`` / ``write_parquet``. The
output is a folder of part files, Ray Data's convention (on a multi-node cluster give a path every node
can write, e.g. shared storage). Rows already in that folder (the same input fields) are skipped, so a
job that stopped can be run again.

Needs ``pip install -e ".[ray]"``.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from generate.tools.batch import Defaults, check_columns, file_format, input_key, run_rows, with_results


def require_ray() -> Any:
    """Import ray (and Ray Data); ImportError with the install line when missing."""
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise ImportError("--ray needs Ray Data; install the extra with pip install -e '.[ray]'") from e
    return ray


class BatchWorker:
    """A Ray Data actor: loads the model once, then generates for each batch of rows it is given."""

    def __init__(
        self, load_options: dict[str, Any], defaults: dict[str, Any], slots: int, threads: int
    ) -> None:
        import torch

        from generate.api import load

        torch.set_num_threads(threads)
        self.gen = load(**load_options)
        self.defaults = Defaults(**defaults)
        self.slots = slots

    def __call__(self, table: Any) -> Any:
        # A whole batch that fails (out of memory) raises: Ray retries it, and the job stops if it fails
        # again, as it would locally. Rows that fail alone carry their error.
        return with_results(table, run_rows(self.gen, table.to_pylist(), self.defaults, self.slots))


def run_ray(
    input_path: str,
    output_dir: str,
    defaults: Defaults,
    load_options: dict[str, Any],
    *,
    address: str | None,
    workers: int,
    cpus_per_worker: int,
    slots: int,
    rows_per_batch: int = 64,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[int, int]:
    """Run the job on Ray; returns (rows run now, rows skipped as already in ``output_dir``).

    ``address``: a running cluster's (``ray start --head`` prints it; ``auto`` finds the local one); None
    starts a local cluster for this job. ``progress(done, total)`` is called about once a second while
    the rows run: the rows in the part files written so far, of the rows to run. A worker's failure is a
    RuntimeError of one line: the worker's error, and where Ray's logs are.
    """
    ray = require_ray()
    fmt = file_format(input_path, "input")
    output = Path(output_dir)
    if output.exists() and not output.is_dir():
        raise ValueError(f"with --ray the output is a folder of part files; {output_dir} is a file")
    if output.resolve() in Path(input_path).resolve().parents:  # (its rows would read as done)
        raise ValueError(f"the output folder {output_dir} holds the input {input_path}; give another folder")
    load_options = _for_workers(load_options)
    started = not ray.is_initialized()
    if started and address is None:
        # A local cluster: the workers' CPUs plus one for Ray Data's read and write tasks, which would
        # otherwise wait forever for a CPU the workers hold (logical CPUs: the OS shares the cores).
        cpus = max(os.cpu_count() or 1, workers * cpus_per_worker + 1)
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    elif started:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    created = not output.exists()
    try:
        use_gpu = str(load_options.get("device") or "cpu").startswith("cuda")
        _check_resources(ray, workers, cpus_per_worker, use_gpu)
        read = ray.data.read_parquet if fmt == "parquet" else ray.data.read_json
        try:
            ds = read(input_path)
        except FileNotFoundError:  # (its message is the path alone)
            raise ValueError(f"input {input_path} does not exist; give an existing file") from None
        total = remaining = ds.count()
        if total == 0:
            raise ValueError(f"input {input_path} has no rows; give a file with at least one prompt")
        check_columns(ds.columns(), f"input {input_path}")
        if output.is_dir() and any(output.iterdir()):
            done = {input_key(row) for row in read(output_dir).iter_rows()}
            ds = ds.filter(lambda row: input_key(row) not in done)
            remaining = ds.count()
            if remaining == 0:  # every row is there: no workers to start (each would load the model)
                return 0, total
        ds = ds.map_batches(
            BatchWorker,
            fn_constructor_kwargs={"load_options": load_options, "defaults": asdict(defaults), "slots": slots,
                                   "threads": cpus_per_worker},
            batch_format="pyarrow",
            batch_size=rows_per_batch,
            compute=ray.data.ActorPoolStrategy(size=workers),
            num_cpus=cpus_per_worker,
            num_gpus=1 if use_gpu else 0,
        )  # fmt: skip
        output.mkdir(parents=True, exist_ok=True)
        with _watching(output, fmt, remaining, progress):
            if fmt == "parquet":
                ds.write_parquet(output_dir)
            else:  # (pandas writes the JSON: 15 significant digits, its most, not its default 10)
                ds.write_json(output_dir, double_precision=15, force_ascii=False)
    except ray.exceptions.RayError as e:  # a worker's failure: its last line, not Ray's whole report
        if created and output.is_dir() and not any(output.iterdir()):
            output.rmdir()
        lines = str(e).strip().splitlines() or [type(e).__name__]
        # its error's line ("module.Error: message"), not the advice on retrying Ray may print after it
        what = next((line for line in reversed(lines) if re.match(r"[A-Za-z_][\w.]*: ", line)), lines[-1])
        logs = _logs_dir(ray)
        what += f" (Ray's logs: {logs})" if logs else ""
        raise RuntimeError(f"a Ray worker failed: {what}") from None
    finally:
        if started:
            ray.shutdown()
    return remaining, total - remaining


@contextmanager
def console_to_null() -> Iterator[TextIO]:
    """Send this process's standard output and error (the file descriptors, so C++ logging too) to the
    null device while Ray runs a job, and yield a stream on the real standard error for the caller's own
    lines. Ray prints its progress logs, error reports with tracebacks (from the driver and echoed from
    the cluster) and core-worker errors there; its log files keep them all. ``gptgen batch --ray`` uses
    this so that a job prints only its progress and its one line of result or error."""
    streams = sys.stdout, sys.stderr
    for stream in streams:
        if stream is not None:
            stream.flush()
    saved = {fd: _dup_high(fd) for fd in (1, 2)}  # None: closed (a command run with 1>&- or 2>&-)
    opened = os.open(os.devnull, os.O_WRONLY)
    null = _dup_high(opened)
    os.close(opened)
    real_fd = _dup_high(2 if saved[2] is not None else null)
    with (
        os.fdopen(real_fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace") as real,
        os.fdopen(_dup_high(null), "w", encoding="utf-8") as quiet,  # for code that looks up sys.stdout/err
    ):
        try:
            for fd in saved:
                os.dup2(null, fd)
            sys.stdout = sys.stderr = quiet
            yield real
        finally:
            sys.stdout, sys.stderr = streams
            for stream in streams:
                if stream is not None:
                    stream.flush()
            for fd, copy in saved.items():
                if copy is None:  # closed before: closed again
                    os.close(fd)
                else:
                    os.dup2(copy, fd)
                    os.close(copy)
            os.close(null)


def _dup_high(fd: int) -> int | None:
    """A duplicate of ``fd`` numbered 3 or more (so that it cannot take a closed standard stream's number),
    not inherited by child processes (as ``os.dup``'s), or None where ``fd`` is not open."""
    try:
        try:
            import fcntl
        except ImportError:  # (Windows)
            return os.dup(fd)
        return fcntl.fcntl(fd, getattr(fcntl, "F_DUPFD_CLOEXEC", fcntl.F_DUPFD), 3)
    except OSError:
        return None


@contextmanager
def _watching(
    folder: Path, fmt: str, total: int, progress: Callable[[int, int], None] | None
) -> Iterator[None]:
    """While the body runs, call ``progress(rows written, total)`` about once a second, counting the rows
    in the part files that were not in ``folder`` before (a file being written counts what it has)."""
    if progress is None:
        yield
        return
    before = set(os.listdir(folder))
    counted: dict[str, tuple[int, int]] = {}  # name -> (size, rows) as last counted
    stop = threading.Event()

    def rows_written() -> int:
        rows = 0
        for entry in os.scandir(folder):  # the files there now (one renamed or removed counts no more)
            try:
                if entry.name in before or not entry.is_file():
                    continue
                size = entry.stat().st_size
            except OSError:  # gone since the listing
                continue
            if counted.get(entry.name, (-1, 0))[0] != size:
                counted[entry.name] = (size, _rows_in(Path(entry.path), fmt))
            rows += counted[entry.name][1]
        return rows

    def watch() -> None:
        while not stop.wait(1.0):
            progress(min(rows_written(), total), total)

    thread = threading.Thread(target=watch, name="gptgen-ray-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _rows_in(path: Path, fmt: str) -> int:
    """Rows in a part file: its lines (JSON Lines) or its footer's count (Parquet); 0 while unreadable."""
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_metadata(path).num_rows
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except (OSError, ValueError):  # gone, or a Parquet footer not written yet (ArrowInvalid)
        return 0


def _logs_dir(ray: Any) -> str | None:
    """Where this Ray session keeps its logs (on the head node), or None where Ray does not say."""
    try:
        return ray._private.worker._global_node.get_logs_dir_path()
    except Exception:  # a private attribute: any Ray version may lack it
        return None


def _for_workers(load_options: dict[str, Any]) -> dict[str, Any]:
    """The load options as the workers need them: a local checkpoint path made absolute (workers do not
    share the driver's working directory) and checked here; ``cuda:N`` as ``cuda`` (Ray gives each worker
    its own GPU, which it sees as its only one)."""
    options = dict(load_options)
    source = options.get("source")
    if isinstance(source, str) and Path(source).exists():
        options["source"] = str(Path(source).resolve())
    if str(options.get("device") or "").startswith("cuda"):
        options["device"] = "cuda"
    return options


def _check_resources(ray: Any, workers: int, cpus_per_worker: int, use_gpu: bool) -> None:
    """Refuse a job the cluster cannot place (Ray Data would wait for it forever)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    cpus = sum(n.get("CPU", 0) for n in nodes)
    biggest = max((n.get("CPU", 0) for n in nodes), default=0)
    if biggest < cpus_per_worker:
        raise ValueError(
            f"--cpus-per-worker {cpus_per_worker} is more than any node of the cluster has (at most "
            f"{biggest:g}); use at most {int(biggest)}"
        )
    if cpus < workers * cpus_per_worker + 1:
        raise ValueError(
            f"{workers} workers x {cpus_per_worker} CPUs and one CPU for Ray Data's reading and writing need "
            f"{workers * cpus_per_worker + 1} CPUs, but the cluster has {cpus:g}; use fewer --workers or "
            "--cpus-per-worker, or add nodes"
        )
    gpus = sum(n.get("GPU", 0) for n in nodes)
    if use_gpu and gpus < workers:
        raise ValueError(f"{workers} workers on CUDA need {workers} GPUs, but the cluster has {gpus:g}")
