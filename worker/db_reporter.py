"""`DbReporter`: the worker.tlt.reporting.Reporter that writes a running job's metrics, histograms, log lines and
samples to the control plane's database, and registers its artifacts.

Writes are batched: a step's metrics (all names), histogram and samples are each written in one transaction *before
the call returns*, so whatever the loop checkpoints next is never ahead of what the database holds (a worker killed
between the two would otherwise resume past steps whose metrics were lost: a gap). Log lines collect in memory and a
background thread flushes them every `flush_s` (or at once past `max_rows`), so the SSE stream sees them within a
second. Metrics and histograms are upserts on (job, step, name): a step replayed after a resume overwrites its rows,
never duplicates them.
A database restart or failover pauses the job instead of failing it: every write is retried for up to `write_retry_s`
while the error is a transient one (connection refused or cut), the pending rows kept in order, and `should_stop()`
answers from its last reading meanwhile (backend.persistence.db.retry_transient).
Metric and histogram names must be in worker/tlt/metric_catalog.py (ValueError otherwise, nothing written).
Artifacts are registered with the size and sha256 of the bytes a download serves (backend.artifact_store.digest).

    rep = DbReporter(session_factory, job_id=1, attempt=1, artifact_root=settings.artifacts)
    rep.metrics(0, {"reward/mean": 0.5}); rep.close()
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from backend.artifact_store import digest
from backend.lifecycle import JobStatus
from backend.persistence import crud
from backend.persistence.db import TRANSIENT_ERRORS, retry_transient
from worker.tlt.metric_catalog import check_names
from worker.tlt.reporting import ArtifactKind

log = logging.getLogger(__name__)
STOP_STATUSES = frozenset({JobStatus.cancelling, JobStatus.cancelled})


class DbReporter:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        job_id: int,
        attempt: int,
        artifact_root: Path,
        flush_s: float = 0.5,  # background flush period of log lines (the SSE stream polls at 0.5 s)
        max_rows: int = 1000,  # flush at once when this many log lines are pending
        stop_check_s: float = 1.0,  # should_stop() reads the job's status at most this often
        write_retry_s: float = 300.0,  # a write failing with a transient DB error is retried this long (a restart)
    ) -> None:
        self.sessions, self.job_id, self.attempt = sessions, job_id, attempt
        self.artifact_root = artifact_root.resolve()
        self.flush_s, self.max_rows, self.stop_check_s = flush_s, max_rows, stop_check_s
        self.write_retry_s = write_retry_s
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._metrics: list[tuple[int, str, float]] = []
        self._hists: list[tuple[int, str, list[float], list[int]]] = []
        self._logs: list[str] = []
        self._samples: list[tuple[int, list[dict]]] = []
        self._stop_events: list[threading.Event] = []
        self._stopped = False
        self._last_stop_check = 0.0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name=f"db-reporter-{job_id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ Reporter protocol

    def metrics(self, step: int, values: dict[str, float]) -> None:
        check_names(values)  # an unknown name is a bug in the writer: refuse the whole step, write nothing
        rows = [(int(step), name, float(v)) for name, v in values.items()]
        bad = [f"{n}={v}" for _, n, v in rows if not math.isfinite(v)]
        if bad:  # stored as null (SQLite cannot hold NaN); say so in the job's log where a person will see it
            self.log(f"step {step}: non-finite metrics: " + ", ".join(bad))
        with self._lock:
            self._metrics.extend(rows)
        self._flush_durably()

    def histogram(self, step: int, name: str, edges: list[float], counts: list[int]) -> None:
        if len(edges) != len(counts) + 1:
            raise ValueError(f"histogram {name}: {len(edges)} edges for {len(counts)} counts (need counts + 1)")
        check_names([name])
        with self._lock:
            self._hists.append((int(step), name, [float(e) for e in edges], [int(c) for c in counts]))
        self._flush_durably()

    def log(self, line: str) -> None:
        with self._lock:
            self._logs.extend(line.splitlines() or [""])
            full = self._pending() >= self.max_rows
        if full:
            self.flush()

    def samples(self, step: int, rows: list[dict]) -> None:
        with self._lock:
            self._samples.append((int(step), list(rows)))
        self._flush_durably()

    def artifact(self, kind: ArtifactKind, path: Path, step: int | None = None) -> None:
        path = Path(path).resolve()
        if not path.is_relative_to(self.artifact_root):
            raise ValueError(f"artifact {path} is outside the artifact store {self.artifact_root}")
        self._flush_durably()  # the metrics of the step come before its artifact
        size, sha256, is_dir = digest(path)

        def register() -> None:
            with self.sessions() as s:
                crud.register_artifact(s, self.job_id, kind=kind, path=str(path), is_dir=is_dir, size=size,
                                       sha256=sha256, step=step)
                # Retention (the training loop's) deletes old checkpoints after their successor is written.
                gone = [a.id for a in crud.list_artifacts(s, self.job_id, kind="checkpoint")
                        if a.deleted_at is None and not Path(a.path).exists()]
                crud.mark_artifacts_deleted(s, gone)
                s.commit()

        retry_transient(register, for_s=self.write_retry_s, what=f"job {self.job_id}: artifact registration", log=log)
        log.info("job %s: registered %s artifact %s (%d bytes, sha256 %s)", self.job_id, kind, path, size, sha256)

    def should_stop(self) -> bool:
        if self._stopped or any(e.is_set() for e in self._stop_events):
            return True
        now = time.monotonic()
        if now - self._last_stop_check >= self.stop_check_s:
            self._last_stop_check = now
            try:
                with self.sessions() as s:
                    self._stopped = crud.job_status(s, self.job_id) in STOP_STATUSES
            except TRANSIENT_ERRORS:  # the database is away: keep training (and buffering); ask again later
                log.warning("job %s: cannot read the job's status; asking again in %.0f s", self.job_id,
                            self.stop_check_s)
        return self._stopped

    # ------------------------------------------------------------ plumbing

    def add_stop_event(self, event: threading.Event) -> None:
        """An extra stop source (the child's SIGTERM handler)."""
        self._stop_events.append(event)

    def _pending(self) -> int:
        return len(self._metrics) + len(self._hists) + len(self._logs) + len(self._samples)

    def flush(self) -> None:
        """Write everything pending in one transaction. On a database error the rows stay pending and it raises."""
        with self._flush_lock:
            with self._lock:
                metrics, hists, logs, samples = self._metrics, self._hists, self._logs, self._samples
                self._metrics, self._hists, self._logs, self._samples = [], [], [], []
            if not (metrics or hists or logs or samples):
                return
            try:
                with self.sessions() as s:
                    crud.upsert_metrics(s, self.job_id, metrics)
                    for step, name, edges, counts in hists:
                        crud.upsert_histogram(s, self.job_id, step, name, edges, counts)
                    if logs:
                        crud.add_logs(s, self.job_id, self.attempt, logs)
                    for step, rows in samples:
                        crud.add_samples(s, self.job_id, step, rows)
                    s.commit()
            except Exception:
                with self._lock:  # keep them for the next flush, in order
                    self._metrics[:0], self._hists[:0] = metrics, hists
                    self._logs[:0], self._samples[:0] = logs, samples
                raise

    def _flush_durably(self) -> None:
        """flush(), retried over a transient database error for up to `write_retry_s` (the training loop waits: what
        it checkpoints next is never ahead of the database); raises when that is not enough (the attempt fails)."""
        retry_transient(self.flush, for_s=self.write_retry_s, what=f"job {self.job_id}: write", log=log)

    def _flush_loop(self) -> None:
        while not self._closed.wait(self.flush_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - a transient DB error: the rows stay pending, try again next tick
                log.exception("job %s: flush failed; will retry", self.job_id)

    def close(self) -> None:
        """Stop the background thread and write what is pending (raises if that last write fails)."""
        self._closed.set()
        self._thread.join(timeout=30)
        self._flush_durably()
