"""Batch throughput: the local engine vs Ray Data with two workers, on the same file of prompts.

    python bench/batch.py                  # 512 prompts, 32 new tokens each, the shipped model
    python bench/batch.py --rows 2048 --workers 2 --cpus-per-worker 1

Each run is what ``gptgen batch`` does (locally: ``generate.tools.batch.run_file``; on Ray: ``run_ray`` with a
local cluster started for the job, its start-up included). Every row is seeded, so both outputs must be
equal row for row; the run checks that. Prints rows/s and generated tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import generate  # noqa: E402
from bench import cpu_description  # noqa: E402  (bench/bench.py, beside this script)
from generate.tools.batch import Defaults, run_file  # noqa: E402
from generate.tools.ray_batch import run_ray  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="shakespeare")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16, help="slots per engine (local and each worker)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cpus-per-worker", type=int, default=1)
    args = p.parse_args()
    print(cpu_description(), flush=True)
    text = (ROOT / "checkpoints" / "shakespeare" / "heldout.txt").read_text(encoding="utf-8").split()
    rows = [
        {"prompt": " ".join(text[i * 7 : i * 7 + 5 + i % 11]), "id": i, "seed": i} for i in range(args.rows)
    ]
    defaults = Defaults(max_new_tokens=args.new_tokens, temperature=0.8, top_p=0.95)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "prompts.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in rows))
        start = time.perf_counter()
        gen = generate.load(args.checkpoint)
        run_file(gen, source, Path(tmp) / "local.jsonl", defaults, slots=args.batch_size)
        local_s = time.perf_counter() - start
        local = [json.loads(line) for line in (Path(tmp) / "local.jsonl").read_text().splitlines()]
        start = time.perf_counter()
        ray_options = {"workers": args.workers, "cpus_per_worker": args.cpus_per_worker}
        ray_options["slots"] = args.batch_size
        run_ray(str(source), str(Path(tmp) / "ray"), defaults, {"source": args.checkpoint}, address=None,
                **ray_options)  # fmt: skip
        ray_s = time.perf_counter() - start
        lines = [
            line for f in sorted((Path(tmp) / "ray").glob("*.json*")) for line in f.read_text().splitlines()
        ]
        remote = sorted((json.loads(line) for line in lines), key=lambda r: r["id"])
    assert remote == local, "the Ray output differs from the local output"
    tokens = sum(len(r["token_ids"]) for r in local)
    print(f"{args.rows} rows, {tokens:,} tokens generated; {args.checkpoint}; outputs equal row for row")
    print("| run | seconds (model load / cluster start included) | rows/s | tokens/s |")
    print("|---|---|---|---|")
    ray_name = f"Ray, {args.workers} workers x {args.cpus_per_worker} CPU, {args.batch_size} slots each"
    for name, seconds in ((f"local engine, {args.batch_size} slots", local_s), (ray_name, ray_s)):
        print(f"| {name} | {seconds:.1f} | {args.rows / seconds:.1f} | {tokens / seconds:,.0f} |")


if __name__ == "__main__":
    main()
