"""Validation of uploaded prompt datasets (JSONL or Parquet): every row must have the named columns, non-empty;
a prompt column holds a string or a list of chat messages ({role, content}). Bad rows are reported by number.

    python -c "from backend.dataset_store import validate; print(validate('train.jsonl', 'jsonl', ['question', 'answer']))"
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MAX_ERRORS = 20  # bad rows listed in a rejection (the count covers all of them)
MAX_DEPTH = 64  # nesting of arrays/objects a JSONL row may have (a chat prompt needs 3)


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


def _check_value(report: Report, row: int, col: str, value: object, prompt_col: str) -> None:
    if value is None or value == "" or value == []:
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


def validate(path: str | Path, fmt: str, columns: list[str]) -> Report:
    """Check every row for `columns` (the first is the prompt column). Rows are numbered from 1."""
    report = Report()
    prompt_col = columns[0] if columns else ""
    seen: dict[str, None] = {}
    if fmt == "jsonl":
        with open(path, encoding="utf-8", errors="strict") as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                report.num_rows += 1
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    report.bad(i, f"not valid JSON ({e.msg})")
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
                seen.update(dict.fromkeys(obj))
                for col in columns:
                    _check_value(report, i, col, obj.get(col), prompt_col)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        names = list(pf.schema_arrow.names)
        seen.update(dict.fromkeys(names))
        missing = [c for c in columns if c not in names]
        if missing:
            report.num_rows = pf.metadata.num_rows
            report.bad(0, f"missing columns {missing} (file has {names})", rows=max(report.num_rows, 1))
            for col in missing:
                report.bad_columns[col] = report.num_rows
        else:
            row = 0
            for batch in pf.iter_batches(columns=columns, batch_size=4096):
                data = batch.to_pydict()
                for j in range(batch.num_rows):
                    row += 1
                    for col in columns:
                        _check_value(report, row, col, data[col][j], prompt_col)
            report.num_rows = row
    else:
        raise ValueError(f"unknown format {fmt!r}")
    report.columns = list(seen)
    if report.num_rows == 0:
        report.bad(0, "the file has no rows")
    return report
