"""The ``generate`` command: in process through ``generate.tools.cli.main`` and as ``python -m generate``."""

import io
import json
import os
import subprocess
import sys

import pytest

import checkpoints
import generate
from generate.tools.cli import build_parser, main
from helpers import ROOT, command_env, make_model
from model import GPTConfig

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=128)
CLI_DEFAULTS = {"temperature": 0.8, "top_p": 0.95}  # the command's sampling defaults
SAMPLING_FLAGS = (
    "--temperature",
    "--top-k",
    "--top-p",
    "--min-p",
    "--repetition-penalty",
    "--presence-penalty",
    "--frequency-penalty",
    "--seed",
    "--stop",
    "--max-new-tokens",
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("cli") / "ck"
    checkpoints.save(make_model(CONFIG, seed=0, std=0.3), directory)
    return str(directory)


@pytest.fixture(scope="module")
def gen(ckpt) -> generate.Generator:
    return generate.load(ckpt)


def run_cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = command_env()
    return subprocess.run(
        [sys.executable, "-m", "generate", *args],
        cwd=ROOT,
        env=env,
        input=stdin if stdin is not None else b"",
        capture_output=True,
        timeout=120,
    )


def set_stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def json_lines(out: str) -> list[dict]:
    lines = out.splitlines()
    assert lines
    return [json.loads(line) for line in lines]


def assert_one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# --- JSON output -----------------------------------------------------------------------------------------


def test_json_output_has_one_object_per_completion(ckpt, gen, capsys):
    assert main(["Hello world", "-c", ckpt, "--json", "-n", "7", "--seed", "3"]) == 0
    [record] = json_lines(capsys.readouterr().out)
    assert {"text", "token_ids", "finish_reason", "timing"} <= set(record)
    assert record["prompt"] == "Hello world"
    assert record["finish_reason"] == "length"
    assert len(record["token_ids"]) == 7
    assert set(record["timing"]) == {"batch_seconds", "batch_size", "batch_tokens_per_second"}
    expected = gen.generate("Hello world", max_new_tokens=7, seed=3, **CLI_DEFAULTS)
    assert record["text"] == expected.text
    assert record["token_ids"] == expected.token_ids
    assert "logprobs" not in record


def test_a_draft_gives_the_same_text_and_its_counts(ckpt, gen, capsys):
    assert main(["Hello world", "-c", ckpt, "--json", "-n", "12", "--seed", "3", "--draft", "ngram"]) == 0
    [record] = json_lines(capsys.readouterr().out)
    assert record["text"] == gen.generate("Hello world", max_new_tokens=12, seed=3, **CLI_DEFAULTS).text
    assert set(record["speculation"]) == {"proposed", "accepted", "passes", "tokens", "acceptance_rate",
                                          "tokens_per_pass"}  # fmt: skip
    assert record["speculation"]["tokens_per_pass"] >= 1


def test_num_samples_gives_one_object_per_sample_with_seed_plus_k(ckpt, gen, capsys):
    assert main(["Hello", "-c", ckpt, "--json", "-n", "6", "--seed", "5", "--num-samples", "2"]) == 0
    records = json_lines(capsys.readouterr().out)
    assert len(records) == 2
    assert [r["sample"] for r in records] == [0, 1]
    for k, record in enumerate(records):
        assert record["text"] == gen.generate("Hello", max_new_tokens=6, seed=5 + k, **CLI_DEFAULTS).text
    assert records[0]["token_ids"] != records[1]["token_ids"]


def test_json_logprobs(ckpt, gen, capsys):
    assert main(["Hi", "-c", ckpt, "--json", "-n", "5", "-t", "0", "--logprobs"]) == 0
    [record] = json_lines(capsys.readouterr().out)
    expected = gen.generate("Hi", max_new_tokens=5, temperature=0, logprobs=True)
    assert record["logprobs"] == pytest.approx(expected.logprobs, abs=1e-6)
    assert len(record["logprobs"]) == len(record["token_ids"])


def test_greedy_output_equals_the_api(ckpt, gen, capsys):
    assert main(["The quick brown fox", "-c", ckpt, "--json", "-n", "12", "--temperature", "0"]) == 0
    [record] = json_lines(capsys.readouterr().out)
    expected = gen.generate("The quick brown fox", max_new_tokens=12, temperature=0)
    assert record["text"] == expected.text
    assert record["token_ids"] == expected.token_ids


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int8-body"])
def test_dtype_option_loads_the_model_in_that_dtype(ckpt, gen, dtype, capsys):
    args = ["The quick brown fox", "-c", ckpt, "--json", "-n", "8", "-t", "0", "--logprobs"]
    assert main([*args, "--dtype", dtype]) == 0
    [record] = json_lines(capsys.readouterr().out)
    prompt = "The quick brown fox"
    expected = generate.load(ckpt, dtype=dtype).generate(
        prompt, max_new_tokens=8, temperature=0, logprobs=True
    )
    assert record["token_ids"] == expected.token_ids
    assert record["logprobs"] == pytest.approx(expected.logprobs, abs=1e-6)
    fp32 = gen.generate(prompt, max_new_tokens=8, temperature=0, logprobs=True)  # the dtype made a difference
    assert record["logprobs"][0] != pytest.approx(fp32.logprobs[0], abs=1e-6)


def test_int4_with_a_group_size_is_the_api_s_int4(ckpt, capsys, monkeypatch):
    import generate.api

    real, seen = generate.api.load, []
    monkeypatch.setattr(generate.api, "load", lambda *a, **k: seen.append(k) or real(*a, **k))
    args = ["The quick brown fox", "-c", ckpt, "--json", "-n", "8", "-t", "0", "--dtype", "int4-body"]
    assert main([*args, "--group-size", "32"]) == 0
    assert seen[0]["group_size"] == 32 and seen[0]["dtype"] == "int4-body"  # passed on, not left at None
    [record] = json_lines(capsys.readouterr().out)
    expected = generate.load(ckpt, dtype="int4-body", group_size=32).generate(
        "The quick brown fox", max_new_tokens=8, temperature=0
    )
    assert record["token_ids"] == expected.token_ids


@pytest.mark.parametrize("deterministic", [False, True])
def test_batch_size_and_deterministic_reach_the_generator(ckpt, capsys, monkeypatch, deterministic):
    import generate.api

    real, made = generate.api.load, []
    monkeypatch.setattr(generate.api, "load", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    args = ["The quick brown fox", "-c", ckpt, "--json", "-n", "4", "--batch-size", "3"]
    assert main(args + ["--deterministic"] * deterministic) == 0
    assert (made[0].slots, made[0].deterministic) == (3, deterministic)
    assert made[0].width(1) == (3 if deterministic else 1)
    assert len(json_lines(capsys.readouterr().out)) == 1


def test_a_group_size_the_model_cannot_take_is_one_error_line(ckpt, capsys):
    # The checkpoint's width is 32: groups of 64 do not divide it.
    assert main(["Hello", "-c", ckpt, "--dtype", "int4", "--group-size", "64"]) == 1
    line = assert_one_error_line(capsys.readouterr().err)
    assert "group_size 64" in line and "width 32" in line


def test_prompts_file_gives_one_object_per_prompt_in_order(ckpt, gen, capsys, tmp_path):
    prompts = ["First prompt", "Second, longer prompt here", "x", "Fourth café ✓"]
    path = tmp_path / "prompts.txt"
    lines = ["First prompt", "", "Second, longer prompt here", "   ", "x", "", "Fourth café ✓"]
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    args = ["--prompts-file", str(path), "-c", ckpt, "--json", "-t", "0", "-n", "5", "--batch-size", "3"]
    assert main(args) == 0
    records = json_lines(capsys.readouterr().out)
    assert [r["prompt"] for r in records] == prompts
    expected = gen.generate(prompts, max_new_tokens=5, temperature=0)
    assert [r["text"] for r in records] == [e.text for e in expected]
    assert [r["token_ids"] for r in records] == [e.token_ids for e in expected]


def test_a_prompts_file_of_blank_lines_is_an_error(ckpt, capsys, tmp_path):
    path = tmp_path / "blank.txt"
    path.write_text("\n  \n\n", encoding="utf-8")
    assert main(["--prompts-file", str(path), "-c", ckpt]) == 1
    line = assert_one_error_line(capsys.readouterr().err)
    assert "has no prompts" in line
    assert str(path) in line


def test_prompt_from_stdin_when_absent(ckpt, gen, capsys, monkeypatch):
    set_stdin(monkeypatch, "Hello wörld\n".encode())
    assert main(["-c", ckpt, "--json", "-t", "0", "-n", "4"]) == 0
    [record] = json_lines(capsys.readouterr().out)
    assert record["prompt"] == "Hello wörld"  # the one trailing newline is dropped
    assert record["text"] == gen.generate("Hello wörld", max_new_tokens=4, temperature=0).text


def test_prompt_from_stdin_with_dash_in_a_subprocess(ckpt, gen):
    result = run_cli("-", "-c", ckpt, "--json", "-t", "0", "-n", "6", stdin=b"Once upon a time\n")
    assert result.returncode == 0, result.stderr.decode()
    [record] = json_lines(result.stdout.decode("utf-8"))
    assert record["prompt"] == "Once upon a time"
    expected = gen.generate("Once upon a time", max_new_tokens=6, temperature=0)
    assert record["text"] == expected.text
    assert record["token_ids"] == expected.token_ids


# --- plain output ----------------------------------------------------------------------------------------


def test_streaming_prints_the_completion_and_a_newline(ckpt, gen):
    result = run_cli("To be, or not to be", "-c", ckpt, "-n", "15", "--seed", "4")
    assert result.returncode == 0, result.stderr.decode()
    expected = gen.generate("To be, or not to be", max_new_tokens=15, seed=4, **CLI_DEFAULTS)
    assert expected.text
    assert result.stdout.decode("utf-8") == expected.text + "\n"
    assert result.stderr == b""


def test_streaming_in_process_with_a_stop_string(ckpt, gen, capsys):
    full = gen.generate("To be", max_new_tokens=15, seed=4, **CLI_DEFAULTS).text
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    assert main(["To be", "-c", ckpt, "-n", "15", "--seed", "4", "--stop", stop]) == 0
    out = capsys.readouterr().out
    assert out == full[: full.index(stop)] + "\n"


def test_no_stream_prints_the_same_text(ckpt, gen, capsys):
    assert main(["To be", "-c", ckpt, "-n", "10", "--seed", "8", "--no-stream"]) == 0
    expected = gen.generate("To be", max_new_tokens=10, seed=8, **CLI_DEFAULTS)
    assert capsys.readouterr().out == expected.text + "\n"


# --- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        (["--top-p", "2"], "top_p=2.0"),
        (["--temperature", "-1"], "temperature=-1.0"),
        (["--top-k", "-3"], "top_k=-3"),
        (["--min-p", "1"], "min_p=1.0"),
        (["--repetition-penalty", "0"], "repetition_penalty=0.0"),
        (["--presence-penalty", "3"], "presence_penalty=3.0"),
        (["--frequency-penalty", "-3"], "frequency_penalty=-3.0"),
        (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0, got -1"),
        (["--dtype", "int2"], "invalid choice: 'int2'"),
        (["--num-samples", "0"], "--num-samples must be >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--stop", ""], "--stop needs a non-empty string"),
        (["--stop", "\udced\udca0\udc80"], "holds a lone surrogate, which no text can contain"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--top-k", "2.5"], "invalid int value: '2.5'"),
        (["--temperature", "warm"], "invalid float value: 'warm'"),
        (["--group-size", "32"], "--group-size applies to --dtype int4 or int4-body only, not float32"),
        (["--dtype", "int4", "--group-size", "48"], "argument --group-size: invalid choice: 48"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, mentions, ckpt, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["Hello", "-c", ckpt, *args])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    line = assert_one_error_line(captured.err)
    assert line.startswith("generate: error: ")
    assert mentions in line
    assert captured.out == ""


def test_a_prompt_and_a_prompts_file_together_exit_2(ckpt, capsys, tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main(["Hello", "--prompts-file", str(path), "-c", ckpt])
    assert exit_info.value.code == 2
    assert "not both" in assert_one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("args", "mentions"),
    [(["--top-p", "2"], "top_p=2.0 is out of range"), (["--bogus"], "unrecognized arguments: --bogus")],
)
def test_bad_arguments_in_a_subprocess(args, mentions, ckpt):
    result = run_cli("Hello", "-c", ckpt, *args)
    assert result.returncode == 2
    line = assert_one_error_line(result.stderr.decode())
    assert mentions in line
    assert result.stdout == b""


def test_a_missing_checkpoint_exits_1_naming_the_path(tmp_path):
    missing = tmp_path / "no" / "such" / "checkpoint"
    result = run_cli("Hello", "-c", str(missing), "-n", "2")
    assert result.returncode == 1
    line = assert_one_error_line(result.stderr.decode())
    assert line.startswith("generate: error: ")
    assert str(missing) in line
    assert result.stdout == b""


def test_invalid_utf8_on_stdin_exits_with_one_line(ckpt):
    result = run_cli("-c", ckpt, "-n", "2", stdin=b"caf\xe9 \xff\n")
    assert result.returncode != 0
    line = assert_one_error_line(result.stderr.decode())
    assert "not valid UTF-8" in line
    assert result.stdout == b""


def test_invalid_utf8_on_stdin_in_process(ckpt, capsys, monkeypatch):
    set_stdin(monkeypatch, b"ok \xc3\x28")
    assert main(["-c", ckpt, "-n", "2"]) == 1
    line = assert_one_error_line(capsys.readouterr().err)
    assert "standard input is not valid UTF-8 (line 1, byte 3)" in line


def test_help_mentions_every_sampling_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in SAMPLING_FLAGS:
        assert flag in out, flag
    assert "usage: generate" in out


def test_the_command_module_imports_no_torch_until_it_runs():
    # --help and Ctrl-C during startup must not wait for torch: cli imports it inside main().
    code = "import sys, generate, generate.tools.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_dtype_choices_are_every_load_dtype():
    # The choices are written out in cli.py (importing checkpoints would import torch before it runs).
    from checkpoints import QUANT_MODES
    from checkpoints.placement import DTYPES

    [action] = [a for a in build_parser()._actions if "--dtype" in a.option_strings]
    long_names = {name for name, dtype in DTYPES.items() if str(dtype).removeprefix("torch.") == name}
    assert set(action.choices) == long_names | set(QUANT_MODES)


def test_a_byte_order_mark_is_not_part_of_the_prompt(ckpt, capsys, monkeypatch, tmp_path):
    args = ["-c", ckpt, "--json", "-t", "0", "-n", "4"]
    set_stdin(monkeypatch, b"\xef\xbb\xbfThe quick")
    assert main(args) == 0
    [with_mark] = json_lines(capsys.readouterr().out)
    set_stdin(monkeypatch, b"The quick")
    assert main(args) == 0
    [without] = json_lines(capsys.readouterr().out)
    assert with_mark["prompt"] == "The quick" and with_mark["token_ids"] == without["token_ids"]
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"\xef\xbb\xbfThe quick\n")
    assert main([*args, "--prompts-file", str(path)]) == 0
    assert json_lines(capsys.readouterr().out)[0]["token_ids"] == without["token_ids"]


def test_endless_input_ends_in_one_error_line(ckpt, capsys, monkeypatch):
    import generate.tools.cli as cli

    monkeypatch.setattr(cli, "MAX_INPUT_BYTES", 2**20)  # the real bound is 64 MiB: the same path, sooner
    assert main(["--prompts-file", "/dev/zero", "-c", ckpt]) == 1
    assert "prompts file /dev/zero holds more than 1,048,576 bytes" in assert_one_error_line(
        capsys.readouterr().err
    )
    set_stdin(monkeypatch, b"x" * (2**20 + 1))
    assert main(["-c", ckpt]) == 1
    assert "standard input holds more than 1,048,576 bytes" in assert_one_error_line(capsys.readouterr().err)


def test_an_empty_checkpoint_path_is_one_error_line(capsys):
    assert main(["Hello", "-c", ""]) == 1
    assert "the checkpoint path is empty" in assert_one_error_line(capsys.readouterr().err)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_standard_output_is_one_error_line(ckpt):
    # `generate x > /dev/full`: the streamed line's write fails, and so would ending it.
    with open("/dev/full", "wb") as full:
        result = subprocess.run([sys.executable, "-m", "generate", "x", "-c", ckpt, "-n", "3"], stdout=full,
                                stderr=subprocess.PIPE, cwd=ROOT, env=command_env(), timeout=120)  # fmt: skip
    assert result.returncode == 1
    assert "generate: error: " in assert_one_error_line(result.stderr.decode())
    assert "No space left on device" in result.stderr.decode()


def test_a_closed_standard_output_is_one_error_line(ckpt):
    # `generate x >&-`: the process starts without file descriptor 1.
    code = "import os, subprocess, sys; os.close(1); sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    command = [sys.executable, "-c", code, sys.executable, "-m", "generate", "x", "-c", ckpt, "-n", "3"]
    result = subprocess.run(command, stderr=subprocess.PIPE, cwd=ROOT, timeout=120)
    assert result.returncode == 1
    line = assert_one_error_line(result.stderr.decode())
    assert line == "generate: error: standard output is closed; redirect it to a file instead"


def test_an_output_encoding_without_the_text_s_characters(ckpt, gen):
    # PYTHONIOENCODING=ascii (or a C locale without UTF-8 mode): JSON escapes what the encoding lacks (the
    # same JSON); plain text cannot, and the error says how to get it.
    expected = gen.generate("Hello", max_new_tokens=8, seed=3, **CLI_DEFAULTS)
    assert not expected.text.isascii()
    env = command_env({**os.environ, "PYTHONIOENCODING": "ascii"})
    args = [sys.executable, "-m", "generate", "Hello", "-c", ckpt, "-n", "8", "--seed", "3"]
    result = subprocess.run([*args, "--json"], capture_output=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    assert json_lines(result.stdout.decode("ascii"))[0]["text"] == expected.text
    result = subprocess.run(args, capture_output=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 1
    line = assert_one_error_line(result.stderr.decode())
    assert "standard output's encoding (ascii) cannot write" in line and "PYTHONIOENCODING=utf-8" in line


def test_an_error_with_standard_error_closed_is_not_written_to_standard_output(tmp_path):
    # `generate x -c missing 2>&-`: the error has nowhere to go, and is not taken for a completion.
    code = "import os, subprocess, sys; os.close(2); sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    missing = str(tmp_path / "missing")
    command = [sys.executable, "-c", code, sys.executable, "-m", "generate", "x", "-c", missing]
    result = subprocess.run(command, stdout=subprocess.PIPE, cwd=ROOT, env=command_env(), timeout=120)
    assert (result.returncode, result.stdout) == (1, b"")


def test_a_reader_that_goes_away_with_standard_error_closed_exits_0(ckpt):
    # `generate x 2>&- | head -c 5`: as with standard error open, the command ends quietly.
    code = (
        "import os, subprocess, sys; os.close(2); "
        "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE); p.stdout.read(5); p.stdout.close(); "
        "sys.exit(p.wait())"
    )
    command = [sys.executable, "-c", code, sys.executable, "-m", "generate", "x", "-c", ckpt, "-n", "120"]
    assert subprocess.run(command, cwd=ROOT, env=command_env(), timeout=120).returncode == 0


def test_prompts_from_standard_input_are_named_so_in_errors(ckpt, capsys, monkeypatch):
    # `--prompts-file -` reads standard input; its errors said "- line 2: ..." and "prompts file - ...".
    set_stdin(monkeypatch, ("a\n" + "word " * 200 + "\n").encode())
    assert main(["--prompts-file", "-", "-c", ckpt]) == 1
    line = assert_one_error_line(capsys.readouterr().err)
    assert line.startswith("generate: error: standard input line 2: the prompt has 201 tokens")
    set_stdin(monkeypatch, b"\n \n")
    assert main(["--prompts-file", "-", "-c", ckpt]) == 1
    line = assert_one_error_line(capsys.readouterr().err)
    assert line == "generate: error: standard input has no prompts (only blank lines)"


def test_utf8_arguments_in_a_c_locale_without_utf8_mode(ckpt, gen):
    # Python decodes the arguments with the locale's encoding, ASCII here: "Café" arrived as 'Caf\udcc3\udca9'
    # and was refused as "not valid UTF-8" (it is). The bytes are taken as UTF-8, as a prompt file's are.
    env = command_env({**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"})
    expected = gen.generate("Café", max_new_tokens=12, seed=32, **CLI_DEFAULTS).text
    stop = next(c for c in expected if not c.isascii())
    args = ["Café", "-c", ckpt, "-n", "12", "--seed", "32", "--json", "--stop", stop]
    result = subprocess.run([sys.executable, "-m", "generate", *args], capture_output=True, cwd=ROOT, env=env,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    [record] = json_lines(result.stdout.decode("ascii"))
    assert record["prompt"] == "Café" and record["text"] == expected[: expected.index(stop)]
