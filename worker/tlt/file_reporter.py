"""A `Reporter` that writes a run's record into its run directory (what `tlt train` uses without the service):

    run_dir/metrics.jsonl     {"step": N, "time": unix_s, "metrics": {name: value}}      one line per step
    run_dir/histograms.jsonl  {"step": N, "name": ..., "edges": [...], "counts": [...]}
    run_dir/samples.jsonl     {"step": N, "rows": [{prompt, response, reward, ...}]}
    run_dir/artifacts.jsonl   {"kind": policy|drafter|checkpoint, "path": ..., "step": N|null}
    run_dir/train.log         human-readable lines (also sent to the `tlt` logger)

Metric and histogram names must be in worker/tlt/metric_catalog.py: an unknown name raises ValueError and nothing of
that call is written.
Cancelling: `should_stop()` is True once a file named STOP exists in the run directory (`touch run_dir/STOP`).
Lines are appended and flushed at once, so a reader (or a resumed run) sees every finished step.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from worker.tlt.metric_catalog import check_names
from worker.tlt.reporting import ArtifactKind

log = logging.getLogger("tlt")


def _finite(v: float) -> float | None:
    """JSON has no NaN/inf: write them as null."""
    return v if math.isfinite(v) else None


class FileReporter:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def _append(self, name: str, record: dict) -> None:
        with (self.run_dir / name).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def metrics(self, step: int, values: dict[str, float]) -> None:
        check_names(values)
        clean = {k: _finite(float(v)) for k, v in values.items()}
        self._append("metrics.jsonl", {"step": step, "time": time.time(), "metrics": clean})

    def histogram(self, step: int, name: str, edges: list[float], counts: list[int]) -> None:
        check_names([name])
        self._append("histograms.jsonl", {"step": step, "name": name, "edges": edges, "counts": counts})

    def log(self, line: str) -> None:
        log.info(line)
        with (self.run_dir / "train.log").open("a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")

    def artifact(self, kind: ArtifactKind, path: Path, step: int | None = None) -> None:
        self._append("artifacts.jsonl", {"kind": kind, "path": str(path), "step": step})

    def samples(self, step: int, rows: list[dict]) -> None:
        self._append("samples.jsonl", {"step": step, "rows": rows})

    def should_stop(self) -> bool:
        return (self.run_dir / "STOP").exists()


def read_metrics(run_dir: Path) -> list[dict]:
    """The metrics.jsonl records of a run directory, in order (for tests and the CLI)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
