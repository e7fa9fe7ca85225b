"""The ``gptgen`` command: its subcommands, in process through ``generate.tools.gptgen.main`` and as a
module."""

import subprocess
import sys

import pytest

from generate.tools import cli, gptgen
from helpers import ROOT, command_env

GREEDY_ARGS = ["To be", "-n", "3", "--seed", "1", "-t", "0"]


def run_gptgen(*args: str) -> subprocess.CompletedProcess:
    env = command_env()
    return subprocess.run(
        [sys.executable, "-m", "generate.tools.gptgen", *args],
        cwd=ROOT,
        env=env,
        input=b"",
        capture_output=True,
        timeout=120,
    )


@pytest.mark.parametrize("args", [[], ["bogus"]])
def test_usage_errors_with_standard_error_closed_write_nothing_to_standard_output(args):
    # `gptgen 2>&-`: the usage (or the error) has nowhere to go, and is not printed as output instead.
    code = "import os, subprocess, sys; os.close(2); sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    command = [sys.executable, "-c", code, sys.executable, "-m", "generate.tools.gptgen", *args]
    result = subprocess.run(command, stdout=subprocess.PIPE, cwd=ROOT, env=command_env(), timeout=120)
    assert (result.returncode, result.stdout) == (2, b"")


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_command_and_exits_0(flag, capsys):
    assert gptgen.main([flag]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: gptgen COMMAND")
    assert all(
        f"\n  {name} " in captured.out
        for name in ("generate", "serve", "playground", "score", "attention", "batch")
    )
    assert captured.err == ""


def test_no_command_prints_the_usage_to_stderr_and_exits_2(capsys):
    assert gptgen.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: gptgen COMMAND") and "serve" in captured.err


def test_an_unknown_command_exits_2_with_one_line_naming_it(capsys):
    assert gptgen.main(["genrate", "Hello"]) == 2
    captured = capsys.readouterr()
    line = one_line(captured.err)
    assert (
        line == "gptgen: error: unknown command 'genrate'; choose one of generate, serve, playground, score, "
        "attention, batch"
    )
    assert captured.out == ""


def test_the_module_runs_as_a_command_with_its_exit_codes():
    helped, bare, unknown = run_gptgen("--help"), run_gptgen(), run_gptgen("train")
    assert helped.returncode == 0 and b"generate" in helped.stdout and b"serve" in helped.stdout
    assert bare.returncode == 2 and bare.stdout == b"" and b"usage: gptgen" in bare.stderr
    assert unknown.returncode == 2 and unknown.stdout == b""
    assert "unknown command 'train'" in one_line(unknown.stderr.decode())


def test_help_imports_no_torch():
    # The docstring promises an instant --help: no subcommand module (and so no torch) is imported.
    code = (
        "import sys; from generate.tools import gptgen; assert gptgen.main(['--help']) == 0; "
        "assert 'torch' not in sys.modules and 'generate.tools.cli' not in sys.modules, 'imported too much'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)


def test_generate_help_names_the_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gptgen.main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gptgen generate ")
    assert "--max-new-tokens" in out


def test_generate_usage_errors_name_the_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gptgen.main(["generate", "Hi", "--bogus"])
    assert exit_info.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("gptgen generate: error: unrecognized arguments: --bogus")


def test_generate_prints_what_the_generate_command_prints(capsys):
    assert cli.main(GREEDY_ARGS) == 0
    expected = capsys.readouterr()
    assert gptgen.main(["generate", *GREEDY_ARGS]) == 0
    got = capsys.readouterr()
    assert expected.out.strip()  # three tokens of text, then a newline
    assert (got.out, got.err) == (expected.out, expected.err)
    result = run_gptgen("generate", *GREEDY_ARGS)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode() == expected.out


def test_generate_compile_progress_names_the_subcommand(capsys, monkeypatch):
    import logging

    import generate.api

    logger, real = logging.getLogger("gptgen"), generate.api.load
    monkeypatch.setattr(logger, "handlers", [])  # the handler main() adds goes with the test
    monkeypatch.setattr(logger, "level", logger.level)

    def load(*args, **kwargs):  # the progress line a compile logs, without the compile's half minute
        logger.info("compiling the decode step")
        return real(*args, **{**kwargs, "compile": False})

    monkeypatch.setattr(generate.api, "load", load)
    assert gptgen.main(["generate", *GREEDY_ARGS, "--compile"]) == 0
    assert one_line(capsys.readouterr().err) == "gptgen generate: compiling the decode step"


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        (["--port", "70000"], "--port must be in 0..65535, got 70000"),
        (["--max-slots", "0"], "--max-slots must be in 1..4096, got 0"),
        (["--max-queue", "0"], "--max-queue must be >= 1, got 0"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--api-key", " "], "the API key (--api-key or $GPTGEN_API_KEY) is empty; give a key, or leave"),
        (["--api-key", "abc "], "the API key (--api-key or $GPTGEN_API_KEY) begins or ends with whitespace"),
        (["--api-key", "s\u00e9same"], "holds 'é', U+00E9; use ASCII letters, digits, punctuation"),
        (["--api-key", "a\tb"], "holds '\\t', U+0009; use ASCII"),
    ],
)
def test_serve_usage_errors_exit_2_with_one_line(args, mentions, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gptgen.main(["serve", *args])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    line = one_line(captured.err)
    assert line.startswith("gptgen serve: error: ") and mentions in line
    assert captured.out == ""


def test_serve_never_prints_the_api_key_it_refuses(capsys, monkeypatch):
    for args in (["--api-key", "hunter2 "], []):  # given, then from the environment
        monkeypatch.setenv("GPTGEN_API_KEY", "hunter2\u00e9")
        with pytest.raises(SystemExit) as exit_info:
            gptgen.main(["serve", *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "the API key (--api-key or $GPTGEN_API_KEY) " in err
        assert "hunter2" not in err


def test_serve_usage_error_in_a_subprocess():
    result = run_gptgen("serve", "--port", "70000")
    assert result.returncode == 2 and result.stdout == b""
    assert "--port must be in 0..65535, got 70000" in one_line(result.stderr.decode())


@pytest.mark.parametrize(
    "args",
    [["serve"], ["score", "-"], ["attention", "x", "-o", "a.png"], ["batch", "in.jsonl", "out.jsonl"],
     ["generate", "x"]],
)  # fmt: skip
def test_every_command_refuses_an_unknown_device_as_a_usage_error_before_loading(args, capsys, tmp_path,
                                                                                monkeypatch):  # fmt: skip
    # (serve was listening and logging a failed load, then exit 1; score, attention and batch exit 1)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(SystemExit) as exit_info:
        gptgen.main([*args, "--device", "bogus"])
    assert exit_info.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"gptgen {args[0]}: error: unknown device 'bogus'; use 'cpu'")
    assert list(tmp_path.iterdir()) == [tmp_path / "in.jsonl"]


@pytest.mark.parametrize("name", ["score", "attention"])
def test_score_and_attention_help_and_usage_errors(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gptgen.main([name, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: gptgen {name} ")
    with pytest.raises(SystemExit) as exit_info:
        gptgen.main([name, "x", "--bogus", "-o", "a.png"])
    assert exit_info.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"gptgen {name}: error: unrecognized arguments: --bogus")
