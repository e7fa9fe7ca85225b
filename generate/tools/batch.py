"""Offline batch generation: a file of prompts in, the same rows with their completions out.

``gptgen batch INPUT OUTPUT`` reads JSON Lines (``.jsonl``, ``.json``, ``.ndjson``) or Parquet (``.parquet``)
with a ``prompt`` column and optional per-row ``seed``, ``max_new_tokens``, ``temperature``, ``top_p`` and
``stop``; every row comes out with all its fields plus ``text``, ``finish_reason``, ``token_ids`` and
``error`` (null unless that row failed; a failed row never loses the others).

Locally the rows run on the engine, a chunk at a time, each row in its own slot with its own settings; by
the engine's batch invariance a row's result does not depend on the rows beside it, so a seeded (or greedy)
row gives the same text alone, locally, or on any Ray worker (:mod:`generate.tools.ray_batch`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import checkpoints
from generate.api import Generator
from generate.engine.request import Request, check_prompt
from generate.engine.sampling import SamplingParams

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
ROW_OPTIONS = ("seed", "max_new_tokens", "temperature", "top_p", "stop")
RESULT_FIELDS = ("text", "finish_reason", "token_ids", "error")
CHUNK_ROWS = 256  # rows read, generated and written at a time (the unit of progress and of resuming)


@dataclass(frozen=True)
class Defaults:
    """Settings for rows that do not give their own (the ``generate`` command's defaults)."""

    max_new_tokens: int = 100
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int | None = None
    stop: tuple[str, ...] = ()


def file_format(path: str | os.PathLike[str], what: str) -> str:
    """``"jsonl"`` or ``"parquet"`` from the file name's suffix; ValueError naming the suffixes otherwise."""
    suffix = Path(path).suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    known = ", ".join(JSONL_SUFFIXES + PARQUET_SUFFIXES)
    raise ValueError(f"{what} {path} has an unknown suffix {suffix or '(none)'!r}; use one of {known}")


def check_columns(columns: list[str], where: str) -> None:
    """An input needs a ``prompt`` column and must not hold a column the results would overwrite."""
    if "prompt" not in columns:
        raise ValueError(f"{where} has no 'prompt' column (its columns: {', '.join(columns) or 'none'})")
    clash = [c for c in RESULT_FIELDS if c in columns]
    if clash:
        raise ValueError(f"{where} has a column {clash[0]!r} that the results would overwrite; rename it")


def _request(gen: Generator, row: dict[str, Any], defaults: Defaults) -> Request:
    """The engine request for one row: its own settings where it gives them, else the defaults."""

    def value(name: str) -> Any:
        given = row.get(name)
        if isinstance(given, float) and name in ("seed", "max_new_tokens"):  # a Parquet column with nulls
            given = None if math.isnan(given) else int(given) if given.is_integer() else given
        return getattr(defaults, name) if given is None else given

    prompt = row.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    sampling = SamplingParams(temperature=value("temperature"), top_p=value("top_p"))
    ids = gen.encode(prompt)
    check_prompt(ids, gen.model.config.vocab_size, gen.model.config.n_positions)
    return Request(ids, sampling, value("max_new_tokens"), seed=value("seed"), eos_id=checkpoints.EOT_ID,
                   stop=value("stop"))  # fmt: skip


def failed(row: dict[str, Any], error: str) -> dict[str, Any]:
    """A row's result when it could not run."""
    return {**row, "text": None, "finish_reason": "error", "token_ids": [], "error": error}


def run_rows(
    gen: Generator, rows: list[dict[str, Any]], defaults: Defaults, slots: int
) -> list[dict[str, Any]]:
    """Generate for each row (up to ``slots`` rows at once); returns the rows with their results, in order.

    A row whose settings are invalid, whose prompt does not fit the window, or whose logits turn NaN ends
    with ``finish_reason`` ``"error"`` and the reason in ``error``; the other rows are unaffected.
    """
    results: list[dict[str, Any] | None] = [None] * len(rows)
    requests: dict[int, Request] = {}
    for i, row in enumerate(rows):
        try:
            requests[i] = _request(gen, row, defaults)
        except (ValueError, TypeError) as e:
            results[i] = failed(row, str(e))
    if requests:
        window = gen.model.config.n_positions
        longest = min(window, max(len(r.prompt) + max(1, r.max_new_tokens) for r in requests.values()))
        with gen.lock:  # (the Generator's engine: no other call steps it meanwhile)
            engine = gen.engine(slots, longest)  # (one width for every part of a job: the same bits)
            try:  # (a row whose logits are not finite, or whose sampling fails, fails alone)
                for r in requests.values():
                    engine.add(r)
                while not all(r.done for r in requests.values()):
                    engine.step()
            finally:
                for r in requests.values():
                    if not r.done:
                        engine.cancel(r)
        for i, r in requests.items():
            text = r.text.text if r.text is not None else ""
            results[i] = {**rows[i], "text": None if r.error else text, "finish_reason": r.finish_reason,
                          "token_ids": r.token_ids, "error": r.error}  # fmt: skip
    return results  # type: ignore[return-value]


# --- local files -------------------------------------------------------------------------------------------


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every row of a JSON Lines or Parquet file, as dicts (columns checked)."""
    fmt = file_format(path, "input")
    if fmt == "parquet":
        table = _parquet().read_table(path)
        check_columns(table.column_names, f"input {path}")
        return table.to_pylist()
    data = Path(path).read_bytes()  # (no size cap, unlike a prompts file: a batch input may be large)
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        where = f"line {line}, byte {e.start}"
        raise ValueError(f"input {path} is not valid UTF-8 ({where}); convert it to UTF-8") from None
    rows = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_float=_finite, parse_constant=_finite)
        except json.JSONDecodeError as e:
            raise ValueError(f"input {path} line {number} is not JSON: {e.msg}") from None
        except ValueError as e:  # (from _finite)
            raise ValueError(f"input {path} line {number}: {e}") from None
        if not isinstance(row, dict):
            kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
            got = kinds.get(type(row), "a number")
            raise ValueError(f"input {path} line {number} is not a JSON object but {got}; the input is JSON "
                             "Lines: one object a line")  # fmt: skip
        rows.append(row)
    for number, row in enumerate(rows, 1):
        check_columns(list(row), f"input {path} row {number}")
    return rows


def _finite(text: str) -> float:
    """A JSON number as a float; ValueError for NaN, Infinity and numbers beyond a float (the output could not
    write them back as JSON)."""
    if not math.isfinite(value := float(text)):
        raise ValueError(f"{text} is not a finite number (JSON has no NaN or Infinity; floats stop at "
                         "1.8e308)")  # fmt: skip
    return value


def _json_line(value: Any) -> str:
    """One JSON line, UTF-8 as is; escaped to ASCII where a string holds a lone surrogate (a JSON input may
    spell one as an escape, and UTF-8 cannot carry it): the same value either way."""
    line = json.dumps(value, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return line


def _parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("Parquet files need pyarrow; install it with pip install -e '.[ray]'") from e
    return pq


def input_key(row: dict[str, Any]) -> str:
    """A row's identity for resuming: its input fields, as canonical JSON."""
    return json.dumps({k: v for k, v in row.items() if k not in RESULT_FIELDS}, sort_keys=True, default=str)


class _Journal:
    """The rows finished so far, one JSON line each, appended as chunks finish. For JSON Lines it is the
    output itself (whole rows); beside a Parquet output, which cannot be appended to, a
    ``.partial.jsonl`` file of each row's results and input key, until the table is written at the end."""

    def __init__(self, path: Path, rows: list[dict[str, Any]], whole_rows: bool) -> None:
        self.path, self.whole_rows = path, whole_rows
        self.done = self._resume(rows)

    def _line(self, row: dict[str, Any], result: dict[str, Any]) -> str:
        record = (
            result if self.whole_rows else {"input": input_key(row), **{k: result[k] for k in RESULT_FIELDS}}
        )
        return _json_line(record)

    def _continues(self, line: str, row: dict[str, Any]) -> bool:
        try:
            done = json.loads(line)
        except json.JSONDecodeError:
            return False
        if not isinstance(done, dict):
            return False
        if self.whole_rows:
            return {k: v for k, v in done.items() if k not in RESULT_FIELDS} == row
        return done.get("input") == input_key(row)

    def _resume(self, rows: list[dict[str, Any]]) -> int:
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        lines = data[:end].decode("utf-8", errors="replace").split("\n")[:-1]  # (not splitlines: U+2028)
        tail = data[end:].decode("utf-8", errors="replace")  # a line a crash cut short, or not ours at all
        for number, line in enumerate(lines):
            if number >= len(rows) or not self._continues(line, rows[number]):
                raise self._not_ours(number)
        if tail and (len(lines) >= len(rows) or not self._begins(tail, rows[len(lines)])):
            raise self._not_ours(len(lines))
        if end != len(data):  # the cut line is dropped: that row runs again
            with open(self.path, "r+b") as f:
                f.truncate(end)
        return len(lines)

    def _not_ours(self, number: int) -> ValueError:
        return ValueError(
            f"{self.path} does not continue this input (its row {number + 1} is not the input's); give "
            "another output, or remove it to start again"
        )

    def _begins(self, tail: str, row: dict[str, Any]) -> bool:
        """Whether ``tail`` can be the start of this row's line (cut short by a crash while writing it)."""
        fixed = _json_line(row if self.whole_rows else {"input": input_key(row)})[:-1]
        return tail[: len(fixed)] == fixed[: len(tail)]

    def append(self, rows: list[dict[str, Any]], results: list[dict[str, Any]]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(self._line(r, res) + "\n" for r, res in zip(rows, results, strict=True))
            f.flush()
            os.fsync(f.fileno())
        self.done += len(results)

    def results(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").split("\n")[:-1]]


def run_file(
    gen: Generator,
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    defaults: Defaults,
    *,
    slots: int = 16,
    progress: Callable[[int, int, int], None] | None = None,
) -> tuple[int, int]:
    """Generate for every row of ``input_path`` into ``output_path`` (the same format), resuming: rows
    already in the output are skipped. ``progress(rows done, rows, tokens generated)`` after each chunk.

    Returns:
        (rows run now, rows skipped as already done).
    """
    in_fmt, out_fmt = file_format(input_path, "input"), file_format(output_path, "output")
    if in_fmt != out_fmt:
        raise ValueError(f"the output must be {in_fmt} like the input; give {output_path} a matching suffix")
    output = Path(output_path)
    if output.exists() and os.path.samefile(output, input_path):  # (a link to it too, hard or symbolic)
        raise ValueError(f"the output {output_path} is the input; give another file")
    if not output.parent.is_dir():  # (found here, not once the first chunk is generated)
        raise ValueError(f"the output's folder {output.parent} does not exist; create it, or give another "
                         "output")  # fmt: skip
    rows = read_rows(input_path)
    if not rows:
        raise ValueError(f"input {input_path} has no rows; give a file with at least one prompt")
    parquet = out_fmt == "parquet"
    journal_path = output.with_name(output.name + ".partial.jsonl") if parquet else output
    if parquet and output.exists() and not journal_path.exists():
        done = [input_key(r) for r in _parquet().read_table(output).to_pylist()]
        if done == [input_key(r) for r in rows]:
            return 0, len(rows)  # finished earlier
        raise ValueError(f"{output} exists and is not this input's finished output; give another output")
    journal = _Journal(journal_path, rows, whole_rows=not parquet)
    skipped, tokens = journal.done, 0
    for start in range(skipped, len(rows), CHUNK_ROWS):
        chunk = rows[start : start + CHUNK_ROWS]
        results = run_rows(gen, chunk, defaults, slots)
        journal.append(chunk, results)
        tokens += sum(len(r["token_ids"]) for r in results)
        if progress is not None:
            progress(journal.done, len(rows), tokens)
    if parquet:
        _write_parquet(input_path, journal, output)
    return len(rows) - skipped, skipped


def _write_parquet(input_path: str | os.PathLike[str], journal: _Journal, output: Path) -> None:
    """The input's table (its column types kept) with the result columns from the journal, written whole."""
    pq = _parquet()
    table = with_results(pq.read_table(input_path), journal.results())
    tmp = output.with_name(f".{output.name}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    journal.path.unlink()


def with_results(table: Any, results: list[dict[str, Any]]) -> Any:
    """An Arrow table with the result columns appended, of fixed types (text, finish_reason and error
    strings, token_ids a list of int64), so every chunk and every worker writes the same schema."""
    import pyarrow as pa

    kinds = {"text": pa.string(), "finish_reason": pa.string(), "token_ids": pa.list_(pa.int64()),
             "error": pa.string()}  # fmt: skip
    for name, kind in kinds.items():
        table = table.append_column(name, pa.array([r[name] for r in results], type=kind))
    return table
