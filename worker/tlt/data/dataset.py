"""Loading prompt datasets for RL: JSONL or parquet files, or a built-in (`gsm8k`, `toy-count`, `toy-times`), into `Example`s,
and the train / validation split (the last `validation_size` rows are held out).

    from worker.tlt.data.dataset import load_examples, split_examples
    rows = load_examples(spec.dataset)
    train, val = split_examples(rows, spec.dataset.validation_size)

A row's prompt is a string or a list of chat messages ({"role", "content"}); its answer is the ground truth as
stored (GSM8K keeps the worked solution ending in `#### 72`; reward functions extract what they compare). Column
names come from the spec (`prompt_column`, `answer_column`). Uploaded datasets (`dataset_id`) are files
`<datasets_dir>/<dataset_id>.jsonl` or `.parquet`; the worker passes `datasets_dir` (env `TLT_DATASETS_DIR`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from worker.tlt.config import DatasetSource
from worker.tlt.data.toy import toy_count_rows
from worker.tlt.data.toy_times import toy_times_rows
from worker.tlt.file_guard import current as file_guard

ChatMessages = list[dict[str, str]]

# Rewards live with the task: a built-in dataset's reward functions, used when the spec leaves reward_funcs unset.
BUILTIN_REWARDS: dict[str, list[str]] = {"gsm8k": ["math_accuracy"], "toy-count": ["toy_count"],
                                         "toy-times": ["toy_times"]}


@dataclass(frozen=True)
class Example:
    prompt: str | ChatMessages  # the user's question, or a whole chat (system message included if any)
    answer: str  # ground truth as stored in the dataset
    index: int  # row number in the source file (stable across runs; samples and logs refer to it)


def builtin_path(name: str) -> Path:
    """Path of a built-in dataset file shipped inside the package."""
    if name == "gsm8k":
        return Path(str(resources.files("worker.tlt.data.gsm8k").joinpath("train.jsonl")))
    raise KeyError(f"built-in dataset {name!r} has no file")


def resolve_path(source: DatasetSource, datasets_dir: Path | None = None) -> Path:
    """The file a non-synthetic source reads from."""
    if source.builtin is not None:
        return builtin_path(source.builtin)
    if source.path is not None:  # a file named by the spec: it must resolve inside the allowed roots
        return file_guard().file(source.path)
    root = datasets_dir or (Path(os.environ["TLT_DATASETS_DIR"]) if os.environ.get("TLT_DATASETS_DIR") else None)
    if root is None:
        raise ValueError("dataset_id needs a datasets directory (argument datasets_dir or env TLT_DATASETS_DIR)")
    for suffix in (".jsonl", ".parquet"):
        candidate = root / f"{source.dataset_id}{suffix}"
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"no {source.dataset_id}.jsonl or .parquet under {root}")


def read_records(path: Path) -> list[dict]:
    """All rows of a JSONL or parquet file as dicts."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # local import: parquet support is only needed for parquet files

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from e
    return rows


def _as_prompt(value: object, where: str) -> str | ChatMessages:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
    raise ValueError(f"{where}: prompt must be a string or a list of {{role, content}} messages")


def to_examples(records: list[dict], prompt_column: str, answer_column: str, origin: str = "dataset") -> list[Example]:
    out = []
    for i, rec in enumerate(records):
        if prompt_column not in rec or answer_column not in rec:
            raise ValueError(f"{origin} row {i}: needs columns {prompt_column!r} and {answer_column!r}")
        out.append(Example(_as_prompt(rec[prompt_column], f"{origin} row {i}"), str(rec[answer_column]), i))
    return out


def load_examples(source: DatasetSource, datasets_dir: Path | None = None) -> list[Example]:
    """Every row of the dataset the spec names, in file order."""
    if source.builtin == "toy-count":
        return to_examples(toy_count_rows(), "prompt", "answer", "toy-count")
    if source.builtin == "toy-times":
        return to_examples(toy_times_rows(), "prompt", "answer", "toy-times")
    if source.builtin == "gsm8k":
        # The built-in file has GSM8K's own columns whatever the spec's mapping says.
        return to_examples(read_records(builtin_path("gsm8k")), "question", "answer", "gsm8k")
    path = resolve_path(source, datasets_dir)
    return to_examples(read_records(path), source.prompt_column, source.answer_column, str(path))


def split_examples(rows: list[Example], validation_size: int) -> tuple[list[Example], list[Example]]:
    """(train, validation): validation is the last `validation_size` rows; at least one row stays for training."""
    if len(rows) < 2 and validation_size > 0:
        return rows, []
    v = min(validation_size, len(rows) - 1)
    return (rows[: len(rows) - v], rows[len(rows) - v :]) if v > 0 else (rows, [])
