"""TensorBoard event files for every run, as TRL and verl users expect: `TensorBoardReporter` wraps the run's
Reporter, passes every call through, and also writes each step's scalar metrics (under their own names:
`reward/mean`, `sd/accept_len`, ...), the response-length histogram and a few samples as text to
`run_dir/tensorboard/events.out.tfevents.*` (tensorboardX, no TensorFlow). At the end of the run the directory is
registered as the job's `tensorboard` artifact.

    reporter = TensorBoardReporter(reporter, run_dir / "tensorboard")
    ...                                   # train; every reporter.metrics(step, ...) lands in the events file too
    reporter.finish()                     # close the file, register the artifact (at the last step reported)

    tensorboard --logdir <run_dir>/tensorboard

Without tensorboardX installed (a bare GPU host) the run still trains and says once in its log that no events are
written.
Run the tests: `python -m pytest tests/train/test_train_tensorboard.py -q`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from worker.tlt.reporting import ArtifactKind, Reporter

SAMPLE_ROWS = 4  # samples written as text per step (the dashboard shows them all)


def histogram_moments(edges: list[float], counts: list[int]) -> dict[str, float]:
    """What TensorBoard's raw histogram needs beside the buckets, from bucket midpoints (the run reports buckets only):
    min / max = the outer edges of the non-empty buckets, num, sum, sum of squares."""
    filled = [i for i, c in enumerate(counts) if c > 0]
    if not filled:
        return {"min": 0.0, "max": 0.0, "num": 0.0, "sum": 0.0, "sum_squares": 0.0}
    mids = [(edges[i] + edges[i + 1]) / 2 for i in range(len(counts))]
    return {
        "min": float(edges[filled[0]]),
        "max": float(edges[filled[-1] + 1]),
        "num": float(sum(counts)),
        "sum": float(sum(c * m for c, m in zip(counts, mids, strict=True))),
        "sum_squares": float(sum(c * m * m for c, m in zip(counts, mids, strict=True))),
    }


def _sample_text(rows: list[dict]) -> str:
    """Markdown of the first rows (prompt, response, reward), as TensorBoard's text plugin renders it."""
    parts = []
    for r in rows[:SAMPLE_ROWS]:
        reward = r.get("reward")
        head = f"**reward {reward:.3f}**" if isinstance(reward, int | float) else "**sample**"
        prompt = str(r.get("prompt", ""))[-300:]
        response = str(r.get("response", ""))[:600]
        parts.append(f"{head}\n\n    {prompt!r}\n\n    {response!r}")
    return "\n\n---\n\n".join(parts)


class TensorBoardReporter:
    """A Reporter that writes TensorBoard events beside the one it wraps (which stays the record of the run)."""

    def __init__(self, inner: Reporter, log_dir: Path) -> None:
        self.inner, self.log_dir = inner, Path(log_dir)
        self.writer: Any = None
        self.last_step: int | None = None  # the step the artifact is registered at
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            inner.log("tensorboard: tensorboardX is not installed; no event files are written")
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(logdir=str(self.log_dir), flush_secs=30)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self.inner.metrics(step, values)
        self.last_step = step
        if self.writer is None:
            return
        for name, value in values.items():
            v = float(value)
            if math.isfinite(v):  # TensorBoard draws a NaN as a gap at best; the run's own record keeps it
                self.writer.add_scalar(name, v, global_step=step)
        self.writer.flush()  # a step's scalars are on disk before the next step starts

    def histogram(self, step: int, name: str, edges: list[float], counts: list[int]) -> None:
        self.inner.histogram(step, name, edges, counts)
        if self.writer is None or not counts:
            return
        m = histogram_moments(edges, counts)
        self.writer.add_histogram_raw(name, min=m["min"], max=m["max"], num=m["num"], sum=m["sum"],
                                      sum_squares=m["sum_squares"], bucket_limits=[float(e) for e in edges[1:]],
                                      bucket_counts=[int(c) for c in counts], global_step=step)

    def samples(self, step: int, rows: list[dict]) -> None:
        self.inner.samples(step, rows)
        if self.writer is not None and rows:
            self.writer.add_text("samples", _sample_text(rows), global_step=step)

    def log(self, line: str) -> None:
        self.inner.log(line)

    def artifact(self, kind: ArtifactKind, path: Path, step: int | None = None) -> None:
        self.inner.artifact(kind, path, step)

    def should_stop(self) -> bool:
        return self.inner.should_stop()

    def finish(self) -> None:
        """Close the event file and register the directory as the run's `tensorboard` artifact."""
        if self.writer is None:
            return
        self.writer.close()
        self.writer = None
        if any(self.log_dir.iterdir()):
            self.inner.artifact("tensorboard", self.log_dir, self.last_step)

    def close(self) -> None:
        """Close the event file without registering it (a run that failed)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

