"""`gptgen batch` run locally: every input field kept plus the results, per-row settings, a failed row that
loses no other, resuming, JSON Lines and Parquet. (The Ray runs are in test_batch_ray.py.)"""

from __future__ import annotations

import json
import re
import sys

import pytest

import generate
from generate.tools.batch import CHUNK_ROWS, RESULT_FIELDS, Defaults, input_key, run_file
from generate.tools.commands import batch_main

ROWS = [
    {"prompt": "To be, or not to be", "id": 1, "meta": {"source": "hamlet", "act": 3}},
    {"prompt": "Once upon a time", "id": 2, "seed": 7, "temperature": 1.0, "top_p": 0.9},
    {"prompt": "ROMEO:", "id": 3, "max_new_tokens": 3, "temperature": 0},
    {"prompt": "x", "id": 4, "temperature": -1},  # fails: a negative temperature
    {"prompt": "", "id": 5, "seed": 3, "stop": ["the"]},
    {"prompt": 42, "id": 6},  # fails: not a string
    {"prompt": "And so", "id": 7, "seed": 11, "stop": "e", "max_new_tokens": 12},
]
DEFAULTS = Defaults(max_new_tokens=6, temperature=0.0, top_p=0.95, seed=None)


@pytest.fixture(scope="module")
def ckpt(text_ckpt):
    return text_ckpt


@pytest.fixture(scope="module")
def gen(ckpt):
    return generate.load(ckpt)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def alone(gen, row):
    """The row run by itself through the API, with the same settings."""
    names = ("max_new_tokens", "temperature", "top_p")
    options = {name: row.get(name, getattr(DEFAULTS, name)) for name in names}
    return gen.generate(row["prompt"], **options, seed=row.get("seed"), stop=row.get("stop"))


def test_every_row_keeps_its_fields_and_equals_the_row_alone(gen, tmp_path):
    out = tmp_path / "out.jsonl"
    assert run_file(gen, write_jsonl(tmp_path / "in.jsonl", ROWS), out, DEFAULTS, slots=3) == (len(ROWS), 0)
    results = read_jsonl(out)
    assert len(results) == len(ROWS)
    for row, result in zip(ROWS, results, strict=True):
        assert {k: v for k, v in result.items() if k not in RESULT_FIELDS} == row
        if row["id"] in (4, 6):
            assert result["finish_reason"] == "error" and result["text"] is None and result["token_ids"] == []
            continue
        expected = alone(gen, row)
        assert result["error"] is None
        assert (result["text"], result["token_ids"], result["finish_reason"]) == (
            expected.text, expected.token_ids, expected.finish_reason)  # fmt: skip
    assert "temperature=-1 is out of range" in results[3]["error"]
    assert results[5]["error"] == "prompt must be a string, got int"
    assert len(results[2]["token_ids"]) == 3  # its own max_new_tokens


def test_a_stopped_job_resumes_where_it_stopped(gen, tmp_path):
    rows = [{"prompt": f"Row {i} says", "seed": i, "temperature": 0.9} for i in range(CHUNK_ROWS + 20)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    full = tmp_path / "full.jsonl"
    run_file(gen, source, full, DEFAULTS, slots=8)
    # A job killed after its first chunk, mid-way through writing a line:
    lines = full.read_text(encoding="utf-8").splitlines(keepends=True)
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(lines[:CHUNK_ROWS]) + lines[CHUNK_ROWS][:15], encoding="utf-8")
    assert run_file(gen, source, partial, DEFAULTS, slots=8) == (20, CHUNK_ROWS)
    assert partial.read_text(encoding="utf-8") == full.read_text(encoding="utf-8")
    assert run_file(gen, source, partial, DEFAULTS, slots=8) == (0, len(rows))  # nothing left to do
    # An output that is another input's is not taken for progress.
    write_jsonl(tmp_path / "other.jsonl", [{"prompt": "something else"}])
    with pytest.raises(ValueError, match=r"other\.jsonl does not continue this input \(its row 1"):
        run_file(gen, source, tmp_path / "other.jsonl", DEFAULTS, slots=8)


def test_parquet_in_and_out_gives_the_json_lines_results_and_resumes(gen, tmp_path):
    import pyarrow as pa  # (the ray extra's, which the test extra includes)
    import pyarrow.parquet as pq

    rows = [{"prompt": f"Line {i}", "id": i, "seed": i} for i in range(CHUNK_ROWS + 5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    as_json = tmp_path / "out.jsonl"
    run_file(gen, write_jsonl(tmp_path / "in.jsonl", rows), as_json, DEFAULTS, slots=4)
    out = tmp_path / "out.parquet"
    assert run_file(gen, tmp_path / "in.parquet", out, DEFAULTS, slots=4) == (len(rows), 0)
    table = pq.read_table(out)
    assert table.schema.field("id").type == pa.int64()
    assert table.schema.field("token_ids").type == pa.list_(pa.int64())
    assert table.to_pylist() == read_jsonl(as_json)
    assert not (tmp_path / "out.parquet.partial.jsonl").exists()
    assert run_file(gen, tmp_path / "in.parquet", out, DEFAULTS, slots=4) == (0, len(rows))
    # Stopped after a chunk: the journal beside the output carries the progress.
    out.unlink()
    journal = tmp_path / "out.parquet.partial.jsonl"
    finished = read_jsonl(as_json)[:CHUNK_ROWS]
    journal.write_text("".join(json.dumps({"input": input_key(r)} | {k: r[k] for k in RESULT_FIELDS}) + "\n"
                               for r in finished))  # fmt: skip
    assert run_file(gen, tmp_path / "in.parquet", out, DEFAULTS, slots=4) == (5, CHUNK_ROWS)
    assert pq.read_table(out).to_pylist() == read_jsonl(as_json)


# --- the command ---


def run(argv, capsys, tty=False, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    try:
        code = batch_main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_runs_the_file_and_says_what_it_wrote(ckpt, gen, tmp_path, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", ROWS)
    argv = [source, tmp_path / "out.jsonl", "-c", ckpt, "-n", "6", "-t", "0"]
    code, out, err = run(argv, capsys, tty=True, monkeypatch=monkeypatch)
    assert code == 0 and out == ""
    assert "generating: " in err and f"/{len(ROWS)} rows (" in err
    assert f"\r\x1b[Kwrote {tmp_path / 'out.jsonl'}: {len(ROWS)} rows (0 already there) in " in err
    expected = tmp_path / "api.jsonl"
    run_file(gen, source, expected, DEFAULTS, slots=16)
    assert read_jsonl(tmp_path / "out.jsonl") == read_jsonl(expected)


@pytest.mark.parametrize(
    ("files", "options", "status", "match"),
    [(("in.txt", "out.jsonl"), [], 1, r"input .*in\.txt has an unknown suffix '\.txt'; use one of \.jsonl"),
     (("in.jsonl", "out.parquet"), [], 1, r"the output must be jsonl like the input"),
     (("noprompt.jsonl", "out.jsonl"), [], 1, r"row 1 has no 'prompt' column \(its columns: text\)"),
     (("in.jsonl", "out.jsonl"), ["--workers", "3"], 2, r"--workers and --cpus-per-worker apply with --ray"),
     (("in.jsonl", "out.jsonl"), ["--workers", "2"], 2, r"--workers and --cpus-per-worker apply with --ray"),
     (("in.jsonl", "out.jsonl"), ["--cpus-per-worker", "1"], 2, r"--workers and --cpus-per-worker apply"),
     (("in.jsonl", "out.jsonl"), ["--batch-size", "0"], 2, r"--batch-size must be >= 1, got 0"),
     (("in.jsonl", "out.jsonl"), ["--batch-size", str(10**20)], 1, r"needs about .* \(10{20} slots x "),
     (("in.jsonl", "out.jsonl"), ["-t", "-1"], 2, r"temperature=-1\.0 is out of range"),
     (("in.jsonl", "out.jsonl"), ["--stop", ""], 2, r"stop strings must be non-empty strings, got ''"),
     (("in.jsonl", "out.jsonl"), ["--seed", "-1"], 2, r"seed=-1 is out of range"),
     (("in.jsonl", "out.jsonl"), ["-n", "-1"], 2, r"max_new_tokens must be an integer >= 0, got -1"),
     (("bad.jsonl", "out.jsonl"), [], 1, r"bad\.jsonl line 2 is not JSON"),
     (("array.json", "out.json"), [], 1, r"line 1 is not a JSON object but an array; the input is JSON L"),
     (("huge.jsonl", "out.jsonl"), [], 1, r"huge\.jsonl line 1: 1e400 is not a finite number \(JSON has no"),
     (("nan.jsonl", "out.jsonl"), [], 1, r"nan\.jsonl line 1: NaN is not a finite number"),
     (("missing.jsonl", "out.jsonl"), [], 1, r"No such file or directory")],
)  # fmt: skip
def test_command_errors_are_one_line_and_write_nothing(ckpt, tmp_path, capsys, files, options, status, match):
    write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "noprompt.jsonl", [{"text": "a clash and no prompt"}])
    (tmp_path / "in.txt").write_text("{}\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    (tmp_path / "array.json").write_text('[{"prompt": "a"}, {"prompt": "b"}]\n')
    (tmp_path / "huge.jsonl").write_text('{"prompt": "a", "seed": 1e400}\n')  # (Python reads inf)
    (tmp_path / "nan.jsonl").write_text('{"prompt": "a", "temperature": NaN}\n')
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = run([tmp_path / files[0], tmp_path / files[1], "-c", ckpt, *options], capsys)
    assert code == status and out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(match, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_without_ray_the_command_says_what_to_install(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    source = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    code, _, err = run([source, tmp_path / "out", "-c", ckpt, "--ray"], capsys)
    assert code == 1
    assert err == (
        "gptgen batch: error: --ray needs Ray Data; install the extra with pip install -e '.[ray]'\n"
    )
    assert not (tmp_path / "out").exists()


def test_an_output_that_is_not_ours_is_refused_and_left_whole(gen, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", ROWS[:3])
    foreign = tmp_path / "results.json"
    foreign.write_text('{"a": 1, "b": [1, 2]}')  # one JSON document, no newline: not a cut line of ours
    with pytest.raises(ValueError, match=r"results\.json does not continue this input \(its row 1 "):
        run_file(gen, source, foreign, DEFAULTS, slots=2)
    assert foreign.read_text() == '{"a": 1, "b": [1, 2]}'
    with pytest.raises(ValueError, match=r"input .*empty\.jsonl has no rows"):
        run_file(gen, write_jsonl(tmp_path / "empty.jsonl", []), tmp_path / "out.jsonl", DEFAULTS, slots=2)
    with pytest.raises(ValueError, match=r"the output .*in\.jsonl is the input; give another file"):
        run_file(gen, source, source, DEFAULTS, slots=2)
    with pytest.raises(ValueError, match=r"the output's folder .*missing does not exist; create it, or "):
        run_file(gen, source, tmp_path / "missing" / "out.jsonl", DEFAULTS, slots=2)  # (before any row runs)
    assert not (tmp_path / "missing").exists()


def test_a_line_separator_in_the_text_survives_a_resume(gen, tmp_path):
    """U+2028 is written as it is (ensure_ascii=False) and is not a line break of JSON Lines."""
    rows = [{"prompt": "one\u2028two\u2029three\x85four", "seed": 1}, {"prompt": "more", "seed": 2}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    run_file(gen, source, out, DEFAULTS, slots=2)
    assert run_file(gen, source, out, DEFAULTS, slots=2) == (0, 2)
    first = out.read_text(encoding="utf-8").split("\n")[0]
    assert json.loads(first)["prompt"] == rows[0]["prompt"]
