"""Side-by-side benchmark: gptgen vs Hugging Face transformers on the same GPT-2 124M weights.

    python bench/bench.py            # the full run (several minutes)
    python bench/bench.py --quick    # a smoke run, under a minute

Random weights with GPT-2 124M geometry (``GPT2Config()`` defaults, seeded) are saved once; each library
loads that file in its own worker process (so each process's peak RSS is its own). The parent alternates
the two (A B A B ...) on each measurement and prints medians and the median of paired ratios (ours / HF).
Before timing it checks that both produce identical greedy tokens in fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing: import the project's packages


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and tokens: a smoke run")
    p.add_argument("--rounds", type=int, default=None, help="A/B rounds per measurement (default 5, quick 2)")
    p.add_argument(
        "--dtypes",
        default="float32,bfloat16,int8,int8-body,int4,int4-body",
        help="ours: float32, bfloat16, int8 or int4 (head included), int8-body or int4-body (bf16 head); "
        "int8 and int4 run beside HF bf16",
    )
    p.add_argument("--group-size", type=int, help="int4's group size (default: the loader's, 32)")
    p.add_argument(
        "--measure",
        default="batch1,batch8,prefill",
        help="which rows to time: batch1, batch8, prefill, sampled (batch 1 with the CLI's default sampling, "
        "temperature 0.8 and top-p 0.95; HF bf16 batch 8 takes minutes a call on CPUs without native bf16)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time our compiled decode step (its first compile from an empty cache and a second "
        "process's start with the step on disk)",
    )
    p.add_argument(
        "--model",
        help="a checkpoint directory in the Hugging Face GPT-2 layout (config.json, model.safetensors), e.g. "
        "checkpoints/shakespeare (default: random weights of GPT-2 124M geometry)",
    )
    p.add_argument(
        "--llama-bench",
        metavar="BIN",
        help="llama.cpp's llama-bench binary: also time the --gguf files (decode at batch 1, prefill)",
    )
    p.add_argument(
        "--gguf",
        nargs="+",
        default=[],
        metavar="FILE",
        help="GGUF files of the same model for --llama-bench (e.g. its Q4_0 and Q8_0 conversions)",
    )
    p.add_argument(
        "--wide",
        action="store_true",
        help="also time eager with deterministic=True (8 rows for any call: what determinism costs)",
    )
    p.add_argument("--device", default="cpu", help="where both libraries run: cpu (default), cuda, cuda:N")
    p.add_argument("--worker", choices=["ours", "wide", "compiled", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    int4_only = all(d.startswith("int4") for d in args.dtypes.split(","))
    if args.group_size is not None and not args.worker and not int4_only:
        p.error("--group-size applies to int4 and int4-body only; pass those alone in --dtypes")
    if bool(args.llama_bench) != bool(args.gguf):
        p.error("--llama-bench and --gguf go together: the binary and the GGUF files it times")
    unknown = set(args.measure.split(",")) - {"batch1", "batch8", "prefill", "sampled"}
    if unknown:
        p.error(
            f"--measure: unknown {', '.join(sorted(unknown))}; choose from batch1, batch8, prefill, sampled"
        )
    return args


# ---------------------------------------------------------------- worker side: one library, one dtype


def _peak_rss() -> int:
    """This process's peak resident memory (VmHWM; getrusage's ru_maxrss would include the parent's,
    which a child inherits across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(kind: str, directory: str, dtype_name: str, group_size: int | None, device: str) -> None:
    import torch

    compiled = kind == "compiled"
    if kind in ("ours", "wide", "compiled"):
        import checkpoints
        from generate import Generator, SamplingParams
        from generate.engine.request import Request

        # int8-body / int4-body: quantized blocks, bf16 output head; compiled, as generate.load loads it
        model = checkpoints.load(
            directory, dtype=dtype_name, group_size=group_size, device=device, plain=compiled
        )
        greedy = SamplingParams(temperature=0)
        # "ours" and "compiled": the API's default (an engine as wide as the call; compiled, 1 row for one
        # prompt and 8 for more); "wide": deterministic=True, 8 rows for any call.
        gen = Generator(model, compile=compiled, deterministic=kind == "wide")

        def run_generate(prompts: list[list[int]], new: int, room: int, sampled: bool) -> list[list[int]]:
            engine = gen.engine(gen.width(len(prompts)), max(map(len, prompts)) + room)
            how = SamplingParams(temperature=0.8, top_p=0.95) if sampled else greedy
            rows = [engine.add(Request(p, how, new, seed=0, eos_id=None)) for p in prompts]
            for _ in engine.run():
                pass
            return [r.token_ids for r in rows]

        def prefill(ids: list[int]) -> None:
            with torch.inference_mode():
                model(torch.tensor([ids], device=device), last_only=True)  # prefill is eager
            _sync(device)

        tensors = [*model.named_parameters(), *model.named_buffers()]  # quantized matrices are buffers
        weights = sum(t.numel() * t.element_size() for _, t in tensors if t.dtype != torch.bool)  # no masks
        # An int4 head's plain codes serve the embedding lookup only: a step reads just its rows.
        read = weights - sum(t.nbytes for name, t in tensors if name.endswith("wte.codes"))
    else:
        import transformers

        transformers.logging.set_verbosity_error()
        model = transformers.GPT2LMHeadModel.from_pretrained(directory, dtype=getattr(torch, dtype_name))
        model.eval().to(device)

        def run_generate(prompts: list[list[int]], new: int, room: int, sampled: bool) -> list[list[int]]:
            del room
            longest = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=sampled,
                    pad_token_id=0,
                    **({"temperature": 0.8, "top_p": 0.95, "top_k": 0} if sampled else {}),
                )
            return out[:, longest:].tolist()

        def prefill(ids: list[int]) -> None:
            with torch.inference_mode():
                model(torch.tensor([ids], device=device), logits_to_keep=1)
            _sync(device)

        weights = read = sum(p.numel() * p.element_size() for p in model.parameters())
    info = {"ready": True, "weights": weights, "read": read, "threads": torch.get_num_threads()}
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.perf_counter()
        if job["op"] == "generate":
            tokens = run_generate(
                job["prompts"], job["new"], job.get("room", job["new"]), job.get("sampled", False)
            )
        elif job["op"] == "prefill":
            prefill(job["ids"])
            tokens = None
        else:
            break
        seconds = time.perf_counter() - t0
        rss = _peak_rss()
        print(json.dumps({"seconds": seconds, "tokens": tokens, "peak_rss": rss}), flush=True)


# ---------------------------------------------------------------- parent side


def _sync(device: str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so that a timing covers it."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class Worker:
    """A library in its own process, answering one JSON job per line."""

    def __init__(
        self,
        kind: str,
        directory: str,
        dtype: str,
        compile_dir: str | None = None,
        group_size: int | None = None,
        device: str = "cpu",
    ) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if compile_dir:
            env["GPTGEN_CACHE_DIR"] = compile_dir
        command = [sys.executable, __file__, "--worker", kind, "--dir", directory, "--dtype", dtype]
        command += ["--device", device]
        if group_size is not None:
            command += ["--group-size", str(group_size)]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.info = json.loads(self.proc.stdout.readline())
        self.peak_rss = 0

    def ask(self, **job: object) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        self.peak_rss = answer["peak_rss"]
        return answer

    def close(self) -> None:
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def cpu_description() -> str:
    """The CPU's model name, vector extensions, and whether oneDNN runs bf16 natively here."""
    import torch

    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().splitlines()
    except OSError:
        info = []
    name = next((line.split(":", 1)[1].strip() for line in info if "model name" in line), None)
    flags = set(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    vector = ", ".join(sorted(flags & {"avx512_bf16", "amx_bf16", "avx512f", "avx2"})) or "no AVX flags"
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return f"cpu: {name or platform.processor() or 'unknown'}; {vector} (bf16 native: {native})"


@contextlib.contextmanager
def checkpoint_dir(model: str | None) -> Iterator[str]:
    """``model`` itself, or for None a temporary directory (removed afterwards) holding GPT-2 124M geometry
    with seeded random weights, saved by ``transformers``: the benchmarks' default model."""
    if model:
        yield model
        return
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(directory)
        yield directory


def read_bandwidth(device: str = "cpu") -> float:
    """Bytes per second a sum over a 1 GiB tensor on ``device`` reads, best of 5 (torch, all threads)."""
    import torch

    x = torch.ones(2**28, dtype=torch.float32, device=device)
    x.sum()
    best = min(_timed(lambda: (x.sum(), _sync(device))) for _ in range(5))
    return x.nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_rate(worker: Worker, prompts: list[list[int]], new: int, sampled: bool = False) -> float:
    """Decode tokens/s with prefill excluded: (t(new) - t(1)) over (new - 1) steps, times the batch size."""
    full = worker.ask(op="generate", prompts=prompts, new=new, sampled=sampled)["seconds"]
    first = worker.ask(op="generate", prompts=prompts, new=1, room=new, sampled=sampled)["seconds"]
    return len(prompts) * (new - 1) / max(full - first, 1e-9)


def prefill_ms(worker: Worker, ids: list[int]) -> float:
    """Milliseconds for one forward over ``ids`` with logits for the last position only."""
    return 1000 * worker.ask(op="prefill", ids=ids)["seconds"]


def alternate(workers: dict[str, Worker], measure, rounds: int) -> dict[str, list[float]]:
    """Run ``measure`` on every worker, ``rounds`` times, rotating which goes first in each round."""
    names = list(workers)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(measure(workers[name]))
    return out


def report(name: str, unit: str, results: dict[str, list[float]], higher_is_better: bool) -> dict:
    """Print each library's median and the median of its paired ratios to HF's; return them."""
    hf = results["hf"]
    row: dict[str, float] = {"hf": statistics.median(hf)}
    parts = []
    for lib, values in results.items():
        row[lib] = statistics.median(values)
        if lib == "hf":
            continue
        row[f"{lib}/hf"] = statistics.median(x / y for x, y in zip(values, hf, strict=True))
        parts.append(f"{LABELS[lib]} {row[lib]:8.2f} ({row[f'{lib}/hf']:.2f}x HF)")
    better = "higher is better" if higher_is_better else "lower is better"
    print(f"{name:<34} {unit}: {'; '.join(parts)}; HF {row['hf']:8.2f} ({better})", flush=True)
    return row


LABELS = {"ours": "ours eager", "wide": "ours eager 8 rows", "compiled": "ours compiled", "hf": "HF"}


def run_dtype(directory: str, dtype: str, args: argparse.Namespace, compile_dir: str) -> dict[str, dict]:
    import torch

    from model import GPTConfig, KVCache

    rounds = args.rounds or (2 if args.quick else 5)
    new = 32 if args.quick else 128
    config = json.loads((Path(directory) / "config.json").read_text())
    vocab, window = config.get("vocab_size", 50257), config.get("n_positions", 1024)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (16,), generator=g).tolist()
    batch = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (8, 16, 24, 32, 40, 48, 56, 64)]
    long_prompt = torch.randint(0, vocab, (min(window, 128 if args.quick else 512),), generator=g).tolist()
    # int8 and int4 are weight-only: their activations and KV cache are bf16, so HF runs in bf16 beside them.
    hf_dtype = "bfloat16" if dtype.startswith(("int8", "int4")) else dtype
    dev = args.device
    workers = {"ours": Worker("ours", directory, dtype, group_size=args.group_size, device=dev)}
    if args.wide:
        workers["wide"] = Worker("wide", directory, dtype, group_size=args.group_size, device=dev)
    try:
        if args.compile:
            start = time.perf_counter()
            workers["compiled"] = Worker("compiled", directory, dtype, compile_dir, args.group_size, dev)
            workers["compiled"].ask(op="generate", prompts=[prompt], new=2, room=new)
            took = time.perf_counter() - start
            print(f"[{dtype}] compiled: a first process (empty cache) generates {took:.1f} s after it starts "
                  "(load, compile the 1-row step, first tokens)", flush=True)  # fmt: skip
            start = time.perf_counter()
            workers["compiled"].ask(op="generate", prompts=batch, new=2, room=new)
            took = time.perf_counter() - start
            print(f"[{dtype}] compiled: then batch 8 generates in {took:.1f} s (compiling the 8-row step)",
                  flush=True)  # fmt: skip
            start = time.perf_counter()
            second = Worker("compiled", directory, dtype, compile_dir, args.group_size, dev)
            rss = second.ask(op="generate", prompts=[prompt], new=2, room=new)["peak_rss"]
            took = time.perf_counter() - start
            cuda = dev.startswith("cuda")  # (torch.compile in each process there)
            how = (
                "compiled again, kernels from torch's cache" if cuda else "its compiled step loaded from disk"
            )
            print(f"[{dtype}] compiled: a second process generates {took:.1f} s after it starts ({how}); its "
                  f"peak RSS {rss / 2**20:.0f} MiB (the first process's below includes compiling)",
                  flush=True)  # fmt: skip
            second.close()
        workers["hf"] = Worker("hf", directory, hf_dtype, device=dev)
        tokens = {n: w.ask(op="generate", prompts=batch[:3], new=16)["tokens"] for n, w in workers.items()}
        same = {name: tokens[name] == tokens["hf"] for name in workers if name != "hf"}
        label = dtype if dtype == hf_dtype else f"{dtype} vs HF {hf_dtype}"
        print(
            f"[{dtype}] greedy tokens equal to HF's (3 left-padded prompts, 16 new): "
            + ", ".join(f"{LABELS[n]} {v}" for n, v in same.items())
            + f"; threads ours {workers['ours'].info['threads']}, HF {workers['hf'].info['threads']}",
            flush=True,
        )
        if dtype == "float32" and not all(same.values()):
            raise SystemExit("fp32 greedy tokens differ from transformers: not timing a wrong answer")
        measure = set(args.measure.split(","))
        rows = {}
        bandwidths = []  # read before every batch-1 call (every library alike): the bandwidth drifts

        def batch1(w: Worker) -> float:
            bandwidths.append(read_bandwidth(dev))
            return decode_rate(w, [prompt], new)

        if "batch1" in measure:
            rows["batch1"] = report(
                f"[{label}] decode batch 1 ({new} new)", "tok/s", alternate(workers, batch1, rounds), True
            )
        if "sampled" in measure:
            rows["sampled"] = report(
                f"[{label}] decode batch 1, t 0.8 top-p 0.95",
                "tok/s",
                alternate(workers, lambda w: decode_rate(w, [prompt], new, sampled=True), rounds),
                True,
            )
            if "batch1" in rows:
                print(
                    f"[{label}] sampled / greedy at batch 1: "
                    + ", ".join(f"{LABELS[n]} {rows['sampled'][n] / rows['batch1'][n]:.2f}" for n in workers),
                    flush=True,
                )
        if "batch8" in measure:
            rows["batch8"] = report(
                f"[{label}] decode batch 8 (8..64 prompt)",
                "tok/s",
                alternate(workers, lambda w: decode_rate(w, batch, new), rounds),
                True,
            )
        if "prefill" in measure:
            eager = {k: w for k, w in workers.items() if k != "compiled"}  # prefill is eager in both of ours
            rows["prefill"] = report(
                f"[{label}] prefill {len(long_prompt)} tokens",
                "ms",
                alternate(eager, lambda w: prefill_ms(w, long_prompt), rounds),
                False,
            )
        weights = workers["ours"].info["weights"]
        geometry = GPTConfig(**{k: config[k] for k in ("n_layer", "n_embd", "n_head") if k in config})
        per_token = KVCache.bytes_per_token(geometry, getattr(torch, hf_dtype))
        kv = per_token * (len(prompt) + new)
        # The largest cache the process held: batch 8 spans its longest prompt plus the new tokens.
        kv_max = per_token * len(batch) * (max(map(len, batch)) + new) if "batch8" in measure else kv
        budget = weights + kv_max + 350 * 10**6
        mib = 2**20
        print(
            f"[{dtype}] weights {weights / mib:.0f} MiB (HF {workers['hf'].info['weights'] / mib:.0f}), "
            f"KV cache batch 1 {kv / mib:.1f} MiB, largest {kv_max / mib:.1f} MiB; peak RSS "
            + ", ".join(f"{LABELS[n]} {w.peak_rss / mib:.0f} MiB" for n, w in workers.items())
            + f" (budget for ours eager: weights + KV + 350 MB = {budget / mib:.0f} MiB)",
            flush=True,
        )
        if bandwidths and "batch1" in rows:
            bandwidth = statistics.median(bandwidths)
            read = workers["ours"].info["read"]
            limit = bandwidth / read
            print(
                f"[{dtype}] read bandwidth (1 GiB sum, before each batch-1 call): median "
                f"{bandwidth / 1e9:.1f} GB/s ({min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f}); "
                f"bandwidth limit {limit:.0f} tok/s ({read / mib:.0f} MiB of weights read once a token); "
                "batch 1 at "
                + ", ".join(f"{LABELS[n]} {rows['batch1'][n] / limit:.2f}" for n in workers if n != "hf")
                + " of it",
                flush=True,
            )
    finally:
        for w in workers.values():
            w.close()
    return rows


def llama_cpp(binary: str, files: list[str], threads: int, rounds: int, new: int, prompt: int) -> None:
    """Time GGUF files with llama.cpp's ``llama-bench`` (its JSON output): decode of ``new`` tokens at batch
    1 and a ``prompt``-token prefill, ``rounds`` repetitions, ``threads`` threads; print its figures."""
    for path in files:
        command = [
            binary,
            "-m",
            path,
            "-t",
            str(threads),
            "-r",
            str(rounds),
            "-p",
            str(prompt),
            "-n",
            str(new),
        ]
        try:
            done = subprocess.run([*command, "-o", "json"], capture_output=True, text=True, check=True)
            rows = json.loads(done.stdout)
        except (OSError, subprocess.CalledProcessError, ValueError) as e:
            print(f"[llama.cpp] {path}: llama-bench failed ({e})", flush=True)
            continue
        for row in rows:
            what = (
                f"decode batch 1 ({row['n_gen']} new)"
                if row.get("n_gen")
                else f"prefill {row['n_prompt']} tokens"
            )
            rate = f"{row['avg_ts']:8.2f} tok/s (sd {row.get('stddev_ts', 0):.2f})"
            if not row.get("n_gen"):
                rate += f", {1000 * row['n_prompt'] / row['avg_ts']:.0f} ms"
            kind = row.get("model_type", Path(path).name)
            print(f"[llama.cpp {kind}] {what}: {rate}; {row.get('n_threads')} threads, {Path(path).name}",
                  flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.worker:
        _worker(args.worker, args.dir, args.dtype, args.group_size, args.device)
        return
    import torch
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    print(cpu_description(), flush=True)
    if args.device != "cpu":
        print(f"device: {args.device} ({torch.cuda.get_device_name(args.device)})", flush=True)
    if args.group_size is not None:
        print(f"int4 group size {args.group_size}", flush=True)
    with checkpoint_dir(args.model) as directory, tempfile.TemporaryDirectory() as compile_dir:
        print(f"model: {args.model or 'GPT-2 124M geometry, random weights'}", flush=True)
        for dtype in args.dtypes.split(","):
            run_dtype(directory, dtype, args, compile_dir)  # compiled steps in a fresh cache: a cold start
    if args.llama_bench:
        rounds = args.rounds or (2 if args.quick else 5)
        new, prompt = (32, 128) if args.quick else (128, 512)
        llama_cpp(args.llama_bench, args.gguf, torch.get_num_threads(), rounds, new, prompt)


if __name__ == "__main__":
    main()
