"""A stream beside a hostile client: does the heaviest valid request slow other users down?

    python bench/hostile.py                 # the shipped model, 4 slots

One client streams a greedy completion and times the gaps between its chunks, first with the server to
itself, then while another client sends the heaviest requests the server accepts, one after another:
``echo`` with ``logprobs`` over as many window-long prompts as the queue takes (prompt scoring), and
window-long prompts with ``n`` filling the queue (prefill). Reported per case: the stream's gap p50 and p99
(ms) and the p50's ratio to the unloaded one (the issue's target: within 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve import model_dir, one, percentile, start_server  # noqa: E402 (beside this script)


def heavy_bodies(window: int, queue: int) -> dict[str, dict]:
    prompt = [11] * (window - 1)
    return {
        "echo+logprobs": {"prompt": [prompt] * queue, "max_tokens": 0, "echo": True, "logprobs": 5},
        "prefill (n)": {"prompt": [prompt], "max_tokens": 1, "n": queue, "temperature": 0},
    }


async def stream_gaps(url: str, tokens: int) -> list[float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        _, gaps, _ = await one(client, "Now is the winter of our discontent", tokens)
    return gaps


async def loaded(url: str, tokens: int, body: dict) -> list[float]:
    done = asyncio.Event()

    async def hostile() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            while not done.is_set():
                response = await client.post("/v1/completions", json=body)
                response.raise_for_status()

    task = asyncio.create_task(hostile())
    await asyncio.sleep(0.5)  # its first request is in
    try:
        return await stream_gaps(url, tokens)
    finally:
        done.set()
        await task


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shakespeare", help="shakespeare (default), gpt2-124m, or a directory")
    p.add_argument("--max-slots", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--tokens", type=int, default=200, help="tokens the timed stream asks for")
    args = p.parse_args()
    import json

    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs", flush=True)
    with open("/proc/cpuinfo") as f:
        print(next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "?"), flush=True)
    directory = model_dir(args.model, "/tmp/gptgen-hostile-model")
    window = json.loads((Path(directory) / "config.json").read_text()).get("n_positions", 1024)
    proc, url = start_server(directory, args.max_slots, "float32", ["--max-queue", str(args.max_queue)])
    try:
        base = asyncio.run(stream_gaps(url, args.tokens))
        p50 = statistics.median(base)
        print(f"unloaded: gap p50 {1e3 * p50:.1f} ms, p99 {1e3 * percentile(base, 0.99):.1f} ms", flush=True)
        for name, body in heavy_bodies(window, args.max_queue).items():
            gaps = asyncio.run(loaded(url, args.tokens, body))
            print(
                f"beside {name}: gap p50 {1e3 * statistics.median(gaps):.1f} ms "
                f"({statistics.median(gaps) / p50:.2f}x unloaded), p99 {1e3 * percentile(gaps, 0.99):.1f} ms",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
