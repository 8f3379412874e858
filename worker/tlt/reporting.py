"""How a training run reports what it does. The library writes through a `Reporter`; `tlt train` uses a file
reporter (JSONL in the run directory), the Celery worker one that writes to the control plane's database."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol

ArtifactKind = Literal["policy", "drafter", "checkpoint", "tensorboard"]


class Reporter(Protocol):
    def metrics(self, step: int, values: dict[str, float]) -> None:
        """Scalar metrics of one step; every name is in worker/tlt/metric_catalog.py (ValueError otherwise)."""

    def histogram(self, step: int, name: str, edges: list[float], counts: list[int]) -> None:
        """A whole histogram (e.g. response_length, a catalogue name of kind "histogram") of one step."""

    def log(self, line: str) -> None:
        """One human-readable log line."""

    def artifact(self, kind: ArtifactKind, path: Path, step: int | None = None) -> None:
        """A finished artifact directory or file (written completely before this call)."""

    def samples(self, step: int, rows: list[dict]) -> None:
        """A few (prompt, response, reward) examples of the step, for the dashboard."""

    def should_stop(self) -> bool:
        """True when the job was cancelled: the loop stops at its next safe point."""
