"""The bad-input matrix through the `generate` command: one line on stderr, a non-zero exit, no traceback."""

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoints
import generate.engine.memory
from generate.tools.cli import main
from helpers import make_model
from model import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32)  # GPT-2's vocabulary, a tiny body


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ck")
    checkpoints.save(make_model(TINY, seed=0, std=0.3), directory)
    return directory


def run(argv, capsys, monkeypatch, stdin=b""):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err, pattern):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert re.search(pattern, lines[0]), lines[0]


def broken_copy(ckpt, tmp_path, edit):
    directory = tmp_path / "broken"
    directory.mkdir()
    (directory / "config.json").write_text((ckpt / "config.json").read_text())
    edit(directory)
    return directory


def write_weights(directory, ckpt, change):
    tensors = load_file(ckpt / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def raw_header(directory, header_len, body):
    (directory / "model.safetensors").write_bytes(header_len.to_bytes(8, "little") + body)


def weights(change):
    return lambda d, c: write_weights(d, c, change)


def files(**contents):
    """Write the weights unchanged, then the named files (``config_json``, ``index_json``)."""

    def edit(d, c):
        write_weights(d, c, lambda t: None)
        for name, text in contents.items():
            path = d / name.replace("_json", ".json").replace("index", "model.safetensors.index")
            if text is None:
                path.unlink()
            else:
                path.write_text(text(c) if callable(text) else text)

    return edit


def wider_config(c):
    return json.dumps({**json.loads((c / "config.json").read_text()), "n_embd": 32})


CHECKPOINT_CASES = {
    "empty file": (lambda d, c: (d / "model.safetensors").write_bytes(b""), "too short to be a safetensors"),
    "random bytes": (lambda d, c: (d / "model.safetensors").write_bytes(os.urandom(4096)), "safetensors"),
    "header claims more": (lambda d, c: raw_header(d, 10**6, b"{}"), "header claims 1000000 bytes"),
    "header not JSON": (lambda d, c: raw_header(d, 5, b"{nope"), "header is not valid JSON"),
    "wrong shape": (
        weights(lambda t: t.update({"transformer.wpe.weight": torch.zeros(32, 8)})),
        r"transformer\.wpe\.weight has shape \(32, 8\) but the config implies \(32, 16\)",
    ),
    "wrong dtype": (
        weights(lambda t: t.update({"transformer.ln_f.bias": torch.zeros(16).int()})),
        "ln_f.bias has dtype 'I32'",
    ),
    "missing key": (weights(lambda t: t.pop("transformer.ln_f.bias")), r"missing keys \['ln_f.bias'\]"),
    "unexpected key": (weights(lambda t: t.update({"transformer.extra": torch.zeros(2)})), "unexpected keys"),
    "no weights": (lambda d, c: None, "has no model.safetensors"),
    "config missing": (files(config_json=None), "config.json does not exist"),
    "config invalid": (files(config_json="{"), "is not valid JSON"),
    "config inconsistent": (files(config_json=wider_config), r"transformer\.\S+ has shape"),
    "single and sharded": (
        files(index_json="{}"),
        "holds both model.safetensors and model.safetensors.index.json",
    ),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_bad_checkpoints(case, ckpt, tmp_path, capsys, monkeypatch):
    edit, pattern = CHECKPOINT_CASES[case]
    directory = broken_copy(ckpt, tmp_path, lambda d: edit(d, ckpt))
    code, out, err = run(["hi", "-c", directory], capsys, monkeypatch)
    assert code == 1 and out == ""
    assert_one_line_error(err, pattern)


def test_missing_path_and_unreadable_file(ckpt, tmp_path, capsys, monkeypatch):
    code, _, err = run(["hi", "-c", tmp_path / "nowhere"], capsys, monkeypatch)
    assert code == 1
    assert_one_line_error(err, "nowhere does not exist")
    real_open = Path.open

    def denied(self, *args, **kwargs):  # tests may run as root, where chmod 000 does not stop reads
        if self.name == "model.safetensors":
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    code, _, err = run(["hi", "-c", ckpt], capsys, monkeypatch)
    assert code == 1
    assert_one_line_error(err, "cannot read .*model.safetensors: .*Permission denied")


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--temperature", "-1"], "temperature=-1.0 is out of range"),
        (["--temperature", "nan"], "temperature=nan is not a finite number"),
        (["--temperature", "inf"], "temperature=inf is not a finite number; temperature must be >= 0"),
        (["--top-k", "-1"], "top_k=-1 is out of range"),
        (["--top-p", "0"], r"top_p=0.0 is out of range; top_p must be in \(0, 1\]"),
        (["--top-p", "1.5"], "top_p=1.5 is out of range"),
        (["--min-p", "1"], r"min_p=1.0 is out of range; min_p must be in \[0, 1\)"),
        (["--repetition-penalty", "0"], "repetition_penalty=0.0 is out of range"),
        (["--presence-penalty", "3"], r"presence_penalty=3.0 is out of range; .* in \[-2, 2\]"),
        (["--frequency-penalty", "-3"], "frequency_penalty=-3.0 is out of range"),
        (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0, got -1"),
        (["--num-samples", "0"], "--num-samples must be >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--stop", ""], "--stop needs a non-empty string"),
        (["--dtype", "int2"], "argument --dtype: invalid choice: 'int2'"),
        (["--device", "toaster"], "unknown device 'toaster'"),
        (["--device", "cuda"], "device 'cuda' is not available"),
        (["--top-k", "2.5"], "argument --top-k: invalid int value: '2.5'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_parameters_are_usage_errors(argv, pattern, ckpt, capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_info:
        run(["hi", "-c", ckpt, *argv], capsys, monkeypatch)
    assert exit_info.value.code == 2
    assert_one_line_error(capsys.readouterr().err, pattern)


def test_float16_on_a_device_that_cannot_compute_it(ckpt, capsys, monkeypatch):
    real = torch.nn.functional.layer_norm

    def no_half(x, *args, **kwargs):
        if x.dtype == torch.float16:
            raise RuntimeError("\"LayerNormKernelImpl\" not implemented for 'Half'")
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "layer_norm", no_half)
    with pytest.raises(SystemExit) as exit_info:
        run(["hi", "-c", ckpt, "--dtype", "float16"], capsys, monkeypatch)
    assert exit_info.value.code == 2
    assert_one_line_error(
        capsys.readouterr().err, "cannot compute in torch.float16 .*use float32 or bfloat16"
    )


@pytest.mark.parametrize(
    ("argv", "stdin", "outputs"),
    [
        ([""], b"", 1),  # empty prompt: starts from <|endoftext|>
        (["   \n\t "], b"", 1),  # whitespace only is ordinary text
        (["a <|endoftext|> inside"], b"", 1),  # plain text, not the special token
        (["-"], "héllo wörld 🎉".encode(), 1),  # stdin
        (["--max-new-tokens", "0"], b"", 1),
    ],
)
def test_odd_but_valid_prompts(argv, stdin, outputs, ckpt, capsys, monkeypatch):
    if argv[0].startswith("--"):
        argv = ["x", *argv]
    code, out, err = run(["-n", "5", *argv, "-c", ckpt, "--json", "--seed", "0"], capsys, monkeypatch, stdin)
    assert code == 0 and err == ""
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == outputs
    assert records[0]["finish_reason"] in ("stop", "length")
    if "--max-new-tokens" in argv:
        assert records[0]["text"] == "" and records[0]["token_ids"] == []


def test_prompt_errors(ckpt, tmp_path, capsys, monkeypatch):
    code, _, err = run([" ".join(["word"] * 40), "-c", ckpt], capsys, monkeypatch)
    assert code == 1
    assert_one_line_error(err, "error: the prompt has 40 tokens but the model's window is 32 positions")
    too_long = tmp_path / "too_long.txt"
    too_long.write_text("short\n\n" + " ".join(["word"] * 40) + "\n")
    code, out, err = run(["--prompts-file", too_long, "-c", ckpt, "--json"], capsys, monkeypatch)
    assert code == 1 and out == ""  # refused before the first batch runs: nothing half-printed
    assert_one_line_error(err, f"{re.escape(str(too_long))} line 3: the prompt has 40 tokens")
    code, _, err = run(["-c", ckpt], capsys, monkeypatch, stdin=b"\xff\xfe bad")
    assert code == 1
    assert_one_line_error(err, r"standard input is not valid UTF-8 \(line 1, byte 0\)")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n\n")
    code, _, err = run(["--prompts-file", blank, "-c", ckpt], capsys, monkeypatch)
    assert code == 1
    assert_one_line_error(err, "has no prompts")
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("first\n\nsecond\n")
    code, out, _ = run(["--prompts-file", mixed, "-c", ckpt, "--json", "-n", "2"], capsys, monkeypatch)
    assert code == 0 and [json.loads(r)["prompt"] for r in out.splitlines()] == ["first", "second"]


def test_runtime_nan_and_fp16_overflow_are_reported(ckpt, tmp_path, capsys, monkeypatch):
    poison = weights(lambda t: t["transformer.ln_f.weight"].fill_(float("nan")))
    nan = broken_copy(ckpt, tmp_path, lambda d: poison(d, ckpt))
    code, _, err = run(["hi", "-c", nan], capsys, monkeypatch)
    assert code == 1
    assert_one_line_error(err, "NaN or infinite logits")
    big = tmp_path / "big"
    model = make_model(TINY, seed=0, std=0.3)
    with torch.no_grad():
        model.wte.weight.mul_(300.0)  # logits of ~1e5: fp16 holds at most 65504, so they overflow
        model.ln_f.weight.mul_(100.0)
    checkpoints.save(model, big)
    code, _, err = run(["hi", "-c", big, "--dtype", "float16"], capsys, monkeypatch)
    assert code == 1
    assert_one_line_error(err, "NaN or infinite logits.*float16")


def test_request_too_big_for_memory_is_refused_up_front(ckpt, capsys, monkeypatch):
    monkeypatch.setattr(generate.engine.memory, "available_memory", lambda device: 10_000)
    code, out, err = run(["hi", "-c", ckpt], capsys, monkeypatch)
    assert code == 1 and out == ""
    assert_one_line_error(err, r"needs about [\d,]+ MiB .*only 0 MiB are available on cpu; use fewer slots")


@pytest.fixture
def ctrl_c_works():
    """Ctrl-C handled as in a terminal, in this process and the commands it starts: a test run started in
    the background by a shell (``pytest &``) ignores SIGINT, and so would every child it starts."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, handler)


def test_ctrl_c_while_streaming_exits_130_cleanly(tmp_path, ctrl_c_works):
    directory = tmp_path / "slow"
    # Big enough that 1000 tokens take seconds, so the signal surely lands mid-stream. Greedy: sampled, this
    # random model can emit the end-of-text token early (about 1 run in 50) and finish before the signal.
    checkpoints.save(make_model(GPTConfig(n_layer=8, n_head=4, n_embd=256, n_positions=1024)), directory)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "generate", "Once", "-c", str(directory), "-n", "1000", "-t", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout.read(1)  # streaming has begun
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, len(out), out[-200:], err[-2000:])
    assert err == b"" and out.endswith(b"\n")


# Ctrl-C while torch imports numpy: torch takes any failure there for "numpy is missing" and goes on, so the
# interrupt was lost and the command ran to its end with exit 0 (or it aborted from C++). This child sends
# itself SIGINT at that moment: when numpy's import begins, inside torch's import.
_INTERRUPT_DURING_IMPORT = """
import builtins, os, signal, sys
real_import = builtins.__import__
def hook(name, *args, **kwargs):
    if name == "numpy" and "numpy" not in sys.modules and "torch" in sys.modules:
        builtins.__import__ = real_import
        print("signal sent", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, *args, **kwargs)
builtins.__import__ = hook
from {module} import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(
    ("module", "argv", "status"),
    [("generate.tools.cli", ["Once", "-c", "{ckpt}", "-n", "5", "-t", "0"], 130),
     ("generate.tools.serve", ["-c", "{ckpt}", "--port", "0"], 0)],  # a server's normal stop; nothing started
    ids=["generate", "serve"],
)  # fmt: skip
def test_ctrl_c_while_torch_imports_is_not_lost(ckpt, module, argv, status, ctrl_c_works):
    argv = [a.format(ckpt=ckpt) for a in argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = _INTERRUPT_DURING_IMPORT.format(module=module, argv=argv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, cwd=ROOT, timeout=120)
    lines = proc.stderr.decode().splitlines()
    assert lines[:1] == ["signal sent"], lines  # the interrupt did land during the import
    assert proc.returncode == status, lines
    assert proc.stdout == b""
    assert [line for line in lines[1:] if "listening" not in line] == []  # no traceback, no error


def test_import_holding_signals_hands_the_signal_over_once_the_import_ends(
    tmp_path, monkeypatch, ctrl_c_works
):
    from generate.tools.cli import import_holding_signals

    (tmp_path / "swallows_interrupts.py").write_text(
        "import os, signal\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    sum(range(1000))  # the handler runs here\n"
        "except BaseException:\n"
        "    interrupted = True  # what torch does with a failed numpy import\n"
        "else:\n"
        "    interrupted = False\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "swallows_interrupts", raising=False)
    with pytest.raises(KeyboardInterrupt):
        import_holding_signals("swallows_interrupts")
    assert sys.modules["swallows_interrupts"].interrupted is False  # the import itself ran undisturbed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
    import_holding_signals("swallows_interrupts")  # already imported: nothing happens


def test_a_safetensors_file_alone_takes_its_config_from_the_config_option(
    ckpt, tmp_path, capsys, monkeypatch
):
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "weights.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    code, _, err = run(["hi", "-c", alone / "weights.safetensors"], capsys, monkeypatch)
    assert code == 1
    assert_one_line_error(err, r"has no config\.json beside it; .* --config in the commands")
    expected = run(["hi", "-c", ckpt, "-t", "0", "-n", "5"], capsys, monkeypatch)
    argv = ["hi", "-c", alone / "weights.safetensors", "--config", ckpt / "config.json", "-t", "0", "-n", "5"]
    assert run(argv, capsys, monkeypatch) == expected
    assert expected[0] == 0 and expected[1].strip()
    # A preset of another geometry is checked against the file like any config.
    code, _, err = run(["hi", "-c", alone / "weights.safetensors", "--config", "gpt2"], capsys, monkeypatch)
    assert code == 1
    assert_one_line_error(err, r"the config says n_layer=12 but the weights hold 1 layers")
    code, _, err = run(["hi", "-c", alone / "weights.safetensors", "--config", "gpt3"], capsys, monkeypatch)
    assert_one_line_error(err, r"config='gpt3': unknown preset 'gpt3'")


@pytest.mark.parametrize("where", ["checkpoint", "prompts-file", "config"])
def test_a_very_long_path_is_shortened_in_the_error(ckpt, tmp_path, capsys, monkeypatch, where):
    long = "/".join(["d" * 200] * 30)  # 6,029 characters, as in the sweep
    argv = {"checkpoint": ["hi", "-c", f"{long}/x.safetensors"],
            "prompts-file": ["--prompts-file", f"{long}/p.txt", "-c", ckpt],
            "config": ["hi", "-c", ckpt, "--config", f"{long}/config.json"]}[where]  # fmt: skip
    code, _, err = run(argv, capsys, monkeypatch)
    assert code == 1
    assert_one_line_error(err, r"d\.\.\.d")
    assert len(err) < 600, err


def test_checkpoint_errors_shorten_any_huge_word_once():
    from checkpoints.errors import ELIDE_LIMIT, CheckpointError, elide

    error = CheckpointError(f"tensor {'k' * 5000} is missing from {'/p' * 3000}; check the file")
    words = str(error).split()
    assert [len(w) for w in words] == [6, ELIDE_LIMIT - 1, 2, 7, 4, ELIDE_LIMIT - 1, 5, 3, 4]
    assert words[1] == "k" * 98 + "..." + "k" * 98 and words[5].endswith("/p/p;")
    assert elide(str(error)) == str(error)  # idempotent: pickling or re-raising keeps the message
    assert str(CheckpointError("short message")) == "short message"
