"""Server benchmark: `gptgen serve` under 1, 8 and 32 concurrent streaming clients, beside the offline API.

    python bench/serve.py                       # the shipped model
    python bench/serve.py --model gpt2-124m     # random weights of GPT-2 124M geometry

At each concurrency the clients stream greedy completions (mixed prompt lengths, ``--max-tokens`` each,
ignoring nothing: a completion that ends at EOS counts the tokens it has) until ``--requests`` have run,
each client starting its next request as soon as its last ends. Reported: aggregate output tokens/s, time
to first token and between streamed chunks (p50/p99, ms). Then the same requests through the offline API
(``Generator.generate`` with ``batch_size`` = the server's slots) in this process, with the server idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = (
    "Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds that "
    "lour'd upon our house in the deep bosom of the ocean buried. Now are our brows bound with victorious "
    "wreaths, our bruised arms hung up for monuments, our stern alarums changed to merry meetings."
)


def prompts(count: int) -> list[str]:
    """Prompts of mixed lengths (about 2 to 60 tokens), the same for every run."""
    words = TEXT.split()
    return [" ".join(words[: 2 + (7 * i) % 45]) for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, gaps, last, tokens = None, [], None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"]:
                continue
            now = time.perf_counter()
            if first is None:
                first = now - start
            else:
                gaps.append(now - last)
            last = now
    return first, gaps, tokens


async def level(url: str, concurrency: int, requests: list[str], max_tokens: int) -> dict:
    queue = list(requests)
    ttft, gaps, tokens = [], [], 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            first, g, n = await one(client, queue.pop(), max_tokens)
            ttft.append(first)
            gaps.extend(g)
            tokens += n

    async with httpx.AsyncClient(
        base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)
    ) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": len(requests),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "itl_p50_ms": 1e3 * statistics.median(gaps),
        "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
    }


def start_server(model: str, slots: int, dtype: str, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "generate.tools.gptgen",
        "serve",
        "--port",
        "0",
        "-c",
        model,
        "--max-slots",
        str(slots),
        "--dtype",
        dtype,
        "--log-level",
        "warning",
        *extra,
    ]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    url = re.search(r"(http://\S+)", proc.stderr.readline()).group(1)
    while httpx.get(url + "/health").status_code != 200:
        assert proc.poll() is None, "the server exited"
        time.sleep(0.2)
    return proc, url


def model_dir(name: str, scratch: str) -> str:
    if name != "gpt2-124m":
        return str(ROOT / "checkpoints" / name) if name == "shakespeare" else name
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(scratch)
    return scratch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shakespeare", help="shakespeare (default), gpt2-124m, or a directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level (default 64)")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = model_dir(args.model, scratch)
        cpu = platform.processor() or "?"
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), cpu)
        print(
            f"# {args.model} ({args.dtype}), {args.max_slots} slots, {args.max_tokens} tokens a request, "
            f"{os.cpu_count()} CPUs ({cpu}), {platform.python_version()}",
            flush=True,
        )
        proc, url = start_server(model, args.max_slots, args.dtype)
        rows = []
        try:
            asyncio.run(level(url, 2, prompts(4), args.max_tokens))  # warm-up
            for c in map(int, args.concurrency.split(",")):
                rows.append(asyncio.run(level(url, c, prompts(max(args.requests, c)), args.max_tokens)))
                r = rows[-1]
                print(
                    f"concurrency {c:3d}: {r['tokens_per_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:6.0f} "
                    f"p99 {r['ttft_p99_ms']:6.0f} ms  between chunks p50 {r['itl_p50_ms']:5.1f} "
                    f"p99 {r['itl_p99_ms']:6.1f} ms  ({r['tokens']} tokens, {r['seconds']:.1f} s)",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.wait(60)
        import generate

        gen = generate.load(model, dtype=args.dtype)
        same = prompts(args.requests)
        gen.generate(same[:4], max_new_tokens=args.max_tokens, temperature=0, batch_size=args.max_slots)
        start = time.perf_counter()
        outs = gen.generate(same, max_new_tokens=args.max_tokens, temperature=0, batch_size=args.max_slots)
        seconds = time.perf_counter() - start
        offline = sum(len(o.token_ids) for o in outs) / seconds
        print(
            f"offline API, batch_size {args.max_slots}: {offline:7.1f} tok/s on the same {len(same)} requests"
        )
        by = {r["concurrency"]: r for r in rows}
        if 1 in by and 32 in by:
            ratio = by[32]["tokens_per_s"] / by[1]["tokens_per_s"]
            print(f"concurrency 32 / 1 throughput: {ratio:.2f}x (target >= 4)")
        if 1 in by and 8 in by:
            ratio = by[8]["ttft_p99_ms"] / by[1]["ttft_p99_ms"]
            print(f"concurrency 8 / 1 p99 TTFT: {ratio:.2f}x (target <= 4)")


if __name__ == "__main__":
    main()
