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
from dataclasses import asdict
from pathlib import Path
from typing import Any

from generate.batch import Defaults, check_columns, failed, file_format, input_key, result_types, run_rows


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
        import pyarrow as pa

        rows = table.to_pylist()
        try:
            results = run_rows(self.gen, rows, self.defaults, self.slots)
        except (ValueError, RuntimeError, MemoryError) as e:  # the whole batch failed: say so in every row
            results = [failed(row, f"the batch failed: {e}") for row in rows]
        for name, kind in result_types(pa).items():
            table = table.append_column(name, pa.array([r[name] for r in results], type=kind))
        return table


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
) -> tuple[int, int]:
    """Run the job on Ray; returns (rows run now, rows skipped as already in ``output_dir``).

    ``address``: a running cluster's (``ray start --head`` prints it; ``auto`` finds the local one); None
    starts a local cluster for this job.
    """
    ray = require_ray()
    fmt = file_format(input_path, "input")
    if Path(output_dir).exists() and not Path(output_dir).is_dir():
        raise ValueError(f"with --ray the output is a folder of part files; {output_dir} is a file")
    started = not ray.is_initialized()
    if started and address is None:
        # A local cluster: the workers' CPUs plus one for Ray Data's read and write tasks, which would
        # otherwise wait forever for a CPU the workers hold (logical CPUs: the OS shares the cores).
        cpus = max(os.cpu_count() or 1, workers * cpus_per_worker + 1)
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    elif started:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        read = ray.data.read_parquet if fmt == "parquet" else ray.data.read_json
        ds = read(input_path)
        check_columns(ds.columns(), f"input {input_path}")
        total = remaining = ds.count()
        if Path(output_dir).is_dir() and any(Path(output_dir).iterdir()):
            done = {input_key(row) for row in read(output_dir).iter_rows()}
            ds = ds.filter(lambda row: input_key(row) not in done)
            remaining = ds.count()
        use_gpu = str(load_options.get("device") or "cpu").startswith("cuda")
        ds = ds.map_batches(
            BatchWorker,
            fn_constructor_kwargs={"load_options": load_options, "defaults": asdict(defaults), "slots": slots,
                                   "threads": cpus_per_worker},
            batch_format="pyarrow",
            batch_size=rows_per_batch,
            concurrency=workers,
            num_cpus=cpus_per_worker,
            num_gpus=1 if use_gpu else 0,
        )  # fmt: skip
        os.makedirs(output_dir, exist_ok=True)
        (ds.write_parquet if fmt == "parquet" else ds.write_json)(output_dir)
    finally:
        if started:
            ray.shutdown()
    return remaining, total - remaining
