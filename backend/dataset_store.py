"""Validation of uploaded prompt datasets (JSONL or Parquet): every row must have the named columns, non-empty;
a prompt column holds a string or a list of chat messages ({role, content}). A row holds what a job spec may hold:
no NaN or Infinity and no text that is not valid unicode (a lone surrogate such as "\\ud800" would fail later, in the
tokenizer). Bad rows are reported by number; a file over the row cap is refused whole (TooLarge).

    python -c "from backend.dataset_store import validate; print(validate('train.jsonl', 'jsonl', ['question', 'answer']))"
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

MAX_ERRORS = 20  # bad rows listed in a rejection (the count covers all of them)
MAX_DEPTH = 64  # nesting of arrays/objects a JSONL row may have (a chat prompt needs 3)
SURROGATE = re.compile("[\ud800-\udfff]")  # JSON escapes (\uXXXX) can spell them; UTF-8 cannot encode them


PARQUET_BATCH_ROWS = 64  # rows decoded at a time: a few rows of a compressed file can expand a lot


class TooLarge(ValueError):
    """The file has more rows, or a longer row, than the service accepts (TLT_MAX_DATASET_ROWS / _ROW_KB)."""


class NotFinite(ValueError):
    pass


def _refuse_constant(name: str) -> float:
    raise NotFinite(f"{name} is not a number JSON allows")


@dataclass
class Report:
    num_rows: int = 0
    columns: list[str] = field(default_factory=list)  # all columns found (union over rows for JSONL)
    bad_rows: int = 0  # rows with at least one problem
    errors: list[str] = field(default_factory=list)  # the first MAX_ERRORS problems, "row N: ..."
    bad_row_numbers: list[int] = field(default_factory=list)  # the first MAX_ERRORS bad rows (0 = the whole file)
    bad_columns: dict[str, int] = field(default_factory=dict)  # column -> rows where it is missing or invalid
    _last_bad: int = -1  # the row counted last (a row with two bad columns counts once)

    def bad(self, row: int, msg: str, column: str | None = None, rows: int = 1) -> None:
        if row != self._last_bad or row == 0:
            self.bad_rows += rows
            self._last_bad = row
            if len(self.bad_row_numbers) < MAX_ERRORS:
                self.bad_row_numbers.append(row)
        if column is not None:
            self.bad_columns[column] = self.bad_columns.get(column, 0) + rows
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(f"row {row}: {msg}")


def detect_format(filename: str) -> str:
    name = filename.lower()
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    raise ValueError(f"unsupported file type {filename!r}: upload .jsonl or .parquet")


def invalid_text(value: object) -> str | None:
    """What makes `value` unfit for a prompt dataset (a lone surrogate in a string or key, a NaN or infinite float),
    walked level by level without recursion; None when fine."""
    level = [value]
    while level:
        nxt: list[object] = []
        for v in level:
            if isinstance(v, str) and SURROGATE.search(v):
                return f"text {v[:40]!r} is not valid unicode (a lone surrogate)"
            if isinstance(v, float) and not math.isfinite(v):
                return f"{v} is not a finite number"
            if isinstance(v, dict):
                nxt.extend(v.keys())
                nxt.extend(v.values())
            elif isinstance(v, list):
                nxt.extend(v)
        level = nxt
    return None


def _check_value(report: Report, row: int, col: str, value: object, prompt_col: str) -> None:
    if (problem := invalid_text(value)) is not None:
        report.bad(row, f"column {col!r}: {problem}", col)
    elif value is None or value == "" or value == []:
        report.bad(row, f"column {col!r} is missing or empty", col)
    elif col == prompt_col and isinstance(value, list):
        ok = all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                 for m in value)
        if not ok:
            report.bad(row, f"column {col!r}: a message list needs {{role, content}} strings", col)
    elif col == prompt_col and not isinstance(value, str):
        report.bad(row, f"column {col!r} must be a string or a list of messages, got {type(value).__name__}", col)


def nesting_depth(value: object, cap: int = MAX_DEPTH + 1) -> int:
    """Levels of nested lists/dicts ([] and {} count 1, a scalar 0), counted level by level (no recursion) and only
    up to `cap`."""
    depth, level = 0, [value]
    while depth < cap:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            return depth
        depth += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def validate(path: str | Path, fmt: str, columns: list[str], max_rows: int = 0, max_row_bytes: int = 0,
             max_decoded_bytes: int = 0) -> Report:
    """Check every row for `columns` (the first is the prompt column). Rows are numbered from 1. More than `max_rows`
    rows, (JSONL) a line longer than `max_row_bytes` or (parquet) more than `max_decoded_bytes` once decoded raises
    TooLarge; 0 = no cap. Parquet is decoded PARQUET_BATCH_ROWS rows at a time, so memory stays at one batch."""
    report = Report()
    prompt_col = columns[0] if columns else ""
    seen: dict[str, None] = {}
    if fmt == "jsonl":
        with open(path, encoding="utf-8", errors="strict") as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                report.num_rows += 1
                _check_size(report.num_rows, len(line.encode("utf-8", "surrogatepass")), max_rows, max_row_bytes, i)
                try:
                    obj = json.loads(line, parse_constant=_refuse_constant)
                except json.JSONDecodeError as e:
                    report.bad(i, f"not valid JSON ({e.msg})")
                    continue
                except NotFinite as e:  # NaN, Infinity, -Infinity: Python's json reads them, JSON has none
                    report.bad(i, str(e))
                    continue
                except RecursionError:  # deeper than the parser's own stack: far past MAX_DEPTH
                    report.bad(i, f"nested deeper than {MAX_DEPTH} levels")
                    continue
                if nesting_depth(obj) > MAX_DEPTH:
                    report.bad(i, f"nested deeper than {MAX_DEPTH} levels")
                    continue
                if not isinstance(obj, dict):
                    report.bad(i, "not a JSON object")
                    continue
                if (problem := invalid_text(obj)) is not None:  # in any column, used or not: the file is kept whole
                    report.bad(i, problem)
                    continue
                seen.update(dict.fromkeys(obj))
                for col in columns:
                    _check_value(report, i, col, obj.get(col), prompt_col)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        _check_size(pf.metadata.num_rows, 0, max_rows, 0, 0)
        _check_column_chunks(pf.metadata, max_decoded_bytes)
        names = list(pf.schema_arrow.names)
        seen.update(dict.fromkeys(names))
        missing = [c for c in columns if c not in names]
        if missing:
            report.num_rows = pf.metadata.num_rows
            report.bad(0, f"missing columns {missing} (file has {names})", rows=max(report.num_rows, 1))
            for col in missing:
                report.bad_columns[col] = report.num_rows
        else:
            row = decoded = 0
            for batch in pf.iter_batches(columns=columns, batch_size=PARQUET_BATCH_ROWS):
                decoded += batch.nbytes  # decoded size: dictionary-encoded, compressed columns expand here
                if max_decoded_bytes and decoded > max_decoded_bytes:
                    raise TooLarge(f"the file expands past {max_decoded_bytes} bytes when decoded "
                                   "(TLT_MAX_DATASET_DECODED_MB)")
                data = batch.to_pydict()
                for j in range(batch.num_rows):
                    row += 1
                    for col in columns:
                        _check_value(report, row, col, data[col][j], prompt_col)
            report.num_rows = row
    else:
        raise ValueError(f"unknown format {fmt!r}")
    report.columns = list(seen)
    if SURROGATE.search("".join(report.columns)):  # a parquet column name (JSONL keys were checked per row)
        report.bad(0, "a column name is not valid unicode")
    if report.num_rows == 0:
        report.bad(0, "the file has no rows")
    return report


def _check_size(rows: int, row_bytes: int, max_rows: int, max_row_bytes: int, line: int) -> None:
    if max_rows and rows > max_rows:
        raise TooLarge(f"the file has more than {max_rows} rows (TLT_MAX_DATASET_ROWS)")
    if max_row_bytes and row_bytes > max_row_bytes:
        raise TooLarge(f"row {line} is longer than {max_row_bytes} bytes (TLT_MAX_DATASET_ROW_KB)")


def _check_column_chunks(meta: object, max_decoded_bytes: int) -> None:
    """A column chunk whose pages alone decompress past the cap (one huge value compresses to a few bytes): refused
    before any of it is decoded."""
    if not max_decoded_bytes:
        return
    for g in range(meta.num_row_groups):  # type: ignore[attr-defined]
        group = meta.row_group(g)  # type: ignore[attr-defined]
        for c in range(group.num_columns):
            if group.column(c).total_uncompressed_size > max_decoded_bytes:
                raise TooLarge(f"the file expands past {max_decoded_bytes} bytes when decoded "
                               "(TLT_MAX_DATASET_DECODED_MB)")
