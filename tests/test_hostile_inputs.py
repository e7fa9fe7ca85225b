"""Unusual and hostile inputs, each answered the documented way: a clear error naming the value (a
``ValueError`` in the library, one line and exit 1 or 2 in a command), or, where the input is valid, the
right result; never a traceback, and never another row's or request's harm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

import checkpoints
import generate
from checkpoints.errors import MESSAGE_LIMIT, CheckpointError, elide
from generate import SamplingParams, generate_ids
from generate.engine.request import Request
from generate.tools.batch import Defaults, run_file
from helpers import TINY_CONFIGS, make_model, tiny_checkpoint

DEFAULTS = Defaults(max_new_tokens=4, temperature=0.0)


def test_numbers_of_any_numeric_type_are_plain_numbers_once_checked():
    params = SamplingParams(top_p=Fraction(1, 2), top_k=np.int64(5), temperature=np.float32(0.5))
    assert (type(params.top_p), type(params.top_k), type(params.temperature)) == (float, int, float)
    assert (params.top_p, params.top_k) == (0.5, 5)
    model = make_model(TINY_CONFIGS["2x2x32"])
    out = generate_ids(model, [[1, 2]], max_new_tokens=3, sampling=params, seed=np.uint64(7))[0]
    assert len(out.token_ids) == 3


def test_a_float_token_id_is_refused_by_name():
    model = make_model(TINY_CONFIGS["2x2x32"])
    with pytest.raises(ValueError, match=r"prompt 0: the prompt has token id 3\.0, which is not an integer"):
        generate_ids(model, [[1, 3.0]], max_new_tokens=2)


def test_a_stop_string_with_a_lone_surrogate_is_refused():
    with pytest.raises(ValueError, match="holds a lone surrogate"):
        Request([1], stop=("ok\ud800",))


def test_messages_show_huge_and_unencodable_values_shortened_and_escaped():
    text = elide("field " + "x" * 5_000_000 + " and " + "y " * 3_000_000 + "\ud800")
    assert len(text) <= MESSAGE_LIMIT and "\\ud800" in text
    text.encode("utf-8")  # (a lone surrogate would fail here)
    assert elide(text) == text


def test_a_batch_row_with_a_lone_surrogate_runs_and_the_job_writes_every_row(tmp_path, text_ckpt):
    gen = generate.load(text_ckpt)
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "bad \\ud800 one"}\n{"prompt": "fine"}\n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert run_file(gen, source, out, DEFAULTS, slots=2) == (2, 0)
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["prompt"] for r in rows] == ["bad \ud800 one", "fine"]
    assert rows[1]["text"] == gen.generate("fine", max_new_tokens=4, temperature=0).text
    assert run_file(gen, source, out, DEFAULTS, slots=2) == (0, 2)  # and it resumes


def test_a_batch_output_hard_linked_to_the_input_is_refused(tmp_path, text_ckpt):
    gen = generate.load(text_ckpt)
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "a"}\n', encoding="utf-8")
    os.link(source, tmp_path / "out.jsonl")
    with pytest.raises(ValueError, match=r"the output .*out\.jsonl is the input"):
        run_file(gen, source, tmp_path / "out.jsonl", DEFAULTS, slots=1)
    assert source.read_text(encoding="utf-8") == '{"prompt": "a"}\n'


def test_a_parquet_seed_column_with_a_null_seeds_the_other_rows(tmp_path, text_ckpt):
    import pyarrow as pa
    import pyarrow.parquet as pq

    gen = generate.load(text_ckpt)
    table = pa.table({"prompt": ["a", "b"], "seed": pa.array([3.0, float("nan")])})  # a float column
    pq.write_table(table, tmp_path / "in.parquet")
    defaults = Defaults(max_new_tokens=4, temperature=1.0, seed=11)
    run_file(gen, tmp_path / "in.parquet", tmp_path / "out.parquet", defaults, slots=2)
    rows = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["error"] for r in rows] == [None, None]
    assert rows[0]["text"] == gen.generate("a", max_new_tokens=4, temperature=1.0, top_p=0.95, seed=3).text
    assert rows[1]["text"] == gen.generate("b", max_new_tokens=4, temperature=1.0, top_p=0.95, seed=11).text


def test_score_with_standard_output_closed_says_so_at_once(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "generate.tools.gptgen", "score", str(text)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr == "gptgen score: error: standard output is closed; redirect it to a file instead\n"


def test_a_deeply_nested_or_outlandish_index_is_a_checkpoint_error(tmp_path):
    tiny_checkpoint(tmp_path / "single")
    index = tmp_path / "sharded"
    index.mkdir()
    (index / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    (index / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="is not a valid safetensors index"):
        checkpoints.load(index)
    name = "s" * 5000 + ".safetensors"
    (index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": name}}))
    with pytest.raises(CheckpointError, match=r"names shard .sss.*which is missing"):
        checkpoints.load(index)


def test_bytes_after_a_safetensors_files_data_are_refused(tmp_path):
    path, _ = tiny_checkpoint(tmp_path)
    weights = path / "model.safetensors" if path.is_dir() else path
    with open(weights, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match="16 bytes follow its data"):
        checkpoints.load(tmp_path)


def test_library_arguments_of_the_wrong_kind_are_value_errors_naming_them(tmp_path, text_ckpt):
    from pathlib import Path

    from model import GPTConfig

    gen = generate.load(text_ckpt)
    model = gen.model
    refused = [(iter([1, 2, 3]), "got list_iterator$"), (5, "got int$"), (b"ab", "got bytes; decode"),
               (["a", "b"], "got list holding str; score one text a call"),
               ([[1, 2], [3]], "got list holding list; score one"),
               ((1, 2.0), "got tuple holding float;")]  # fmt: skip
    for bad, match in refused:
        with pytest.raises(TypeError, match=rf"^text must be a str or a list of token ids \(ints\), {match}"):
            gen.score(bad)
    assert gen.score([1, 2, np.int64(3)], stride=np.int64(4)).token_ids == [1, 2, 3]
    assert gen.attention("to be", layer=np.int64(0)).shape[0] == model.config.n_head
    cases = [
        (dict(prompts=[1, 2]), r"^prompts must be a list of token id lists, such as \[\[464, 3290\]\]"),
        (dict(prompts=["a b"]), r"^prompts must be a list of token id lists"),
        (dict(sampling={"temperature": 0}), r"^sampling must be a SamplingParams, got dict$"),
        (dict(eos_id="50256"), r"^eos_id='50256' must be a token id \(an integer >= 0\), or None for none$"),
        (dict(eos_id=-1), r"^eos_id=-1 must be a token id"),
        (dict(slots=0), r"^slots=0 must be an integer >= 1, or None for one per prompt$"),
        (dict(compile="no"), r"^compile='no' must be True or False$"),
        (dict(model=gen), r"^model must be a model\.GPT, got Generator \(a Generator's is gen\.model\)$"),
    ]
    for change, match in cases:
        kwargs = dict(model=model, prompts=[[1, 2]], max_new_tokens=2) | change
        with pytest.raises(ValueError, match=match):
            generate_ids(kwargs.pop("model"), kwargs.pop("prompts"), **kwargs)
    assert generate_ids(model, [np.array([1, 2])], max_new_tokens=1, slots=np.int64(1))[0].token_ids
    with pytest.raises(CheckpointError):  # (a path is a checkpoint's, even one spelled "ngram")
        generate.load(text_ckpt, draft=Path(tmp_path / "ngram"))
    for call, match in [
        (lambda: generate.Generator(model, draft=5), r"^draft=5: give 'ngram' or a draft model"),
        (lambda: generate.load(text_ckpt, draft=True), r"^draft=True: give 'ngram' or a draft checkpoint's"),
        (lambda: generate.load(None), r"^source=None must be a checkpoint's path or name"),
        (lambda: generate.load(text_ckpt, config=5), r"^config=5 must be a GPTConfig, a preset name or a"),
        (lambda: checkpoints.save(gen, tmp_path / "x"), r"^model must be a model\.GPT, got Generator"),
        (lambda: checkpoints.save(model, None), r"^directory=None must be a path"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    assert not (tmp_path / "x").exists()
    wide = checkpoints.save(make_model(TINY_CONFIGS["2x2x32"]), tmp_path / "wide")
    assert checkpoints.load(wide, dtype="int4", group_size=np.int64(32)).config == TINY_CONFIGS["2x2x32"]
    config = tmp_path / "huge" / "config.json"
    config.parent.mkdir()
    config.write_text(
        json.dumps(GPTConfig(n_layer=1, n_head=2, n_embd=16).__dict__)[:-1] + ', "x": ' + "9" * 5000 + "}"
    )
    with pytest.raises(CheckpointError, match=r"huge/config\.json is not a config: .*4300"):
        checkpoints.load(config.parent)


def test_an_attention_text_argument_that_is_not_utf8_is_a_usage_error(capsys, tmp_path, monkeypatch):
    from generate.tools import gptgen

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        gptgen.main(["attention", "caf\udce9", "-o", "x.png"])  # (how Python hands over a lone byte 0xe9)
    assert exit_info.value.code == 2
    assert "the text argument is not valid UTF-8 (byte 3)" in capsys.readouterr().err
    assert not os.path.exists("x.png")
