"""The `run_job` Celery task: claims a job row, runs its training in a child process, and records the outcome.

Contract (Celery "Tasks" guide: take ids, re-read the row, check its state, be idempotent):
- The message carries only the job id. A terminal job is skipped; a queued one becomes starting (attempt + 1; one
  queued again by a retry resumes from its last checkpoint); a job still held by another worker (fresh heartbeat) is left alone; a job whose worker stopped heartbeating (SIGKILL,
  power loss: the broker redelivered it thanks to acks_late) becomes recovering and resumes from its last checkpoint.
- The training runs in `python -m worker.job_child JOB_ID` (its own process group, killed if this worker dies), so a
  crash or OOM fails the attempt with the exit status and the error line (the output, traceback included, is in the
  job's log), never the worker.
- A heartbeat thread updates jobs.heartbeat_at and watches for `cancelling`: the child stops cooperatively
  (reporter.should_stop) and is hard-killed after `cancel_grace_s`. The heartbeat also watches the attempt number:
  when this worker was cut off from the database for longer than `heartbeat_timeout_s`, another worker may have
  taken the job over (attempt + 1); the next heartbeat that gets through sees it, kills the child at once and
  returns without writing an outcome (the job belongs to the new attempt).
- A database restart does not fail a job: the claim, the outcome and the final transition are retried over transient
  errors for `DB_RETRY_S`; heartbeats and output lines wait for the database to come back (output kept in order, up
  to `MAX_PENDING_OUTPUT` lines); the child's DbReporter pauses the training the same way.

Run by a worker: `celery -A worker.celery_app worker -Q cpu,gpu --pool threads --concurrency 1`.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

from celery import Celery, Task, shared_task
from celery.signals import worker_ready, worker_shutdown
from sqlalchemy.orm import Session, sessionmaker

from backend.core.config import Settings
from backend.core.dispatch import RUN_JOB_TASK
from backend.lifecycle import FINAL, IllegalTransition, JobStatus
from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory, retry_transient
from worker import registry

log = logging.getLogger(__name__)
S = JobStatus
_factories: dict[str, sessionmaker[Session]] = {}
_factories_lock = threading.Lock()
DB_RETRY_S = 300.0  # how long the supervisor retries a claim / outcome / final transition over a database outage
MAX_PENDING_OUTPUT = 20_000  # child output lines kept while the database is away (then the oldest are dropped)


def session_factory(url: str) -> sessionmaker[Session]:
    """One engine per database URL per worker process (created on first use, not at import)."""
    with _factories_lock:
        if url not in _factories:
            _factories[url] = make_session_factory(make_engine(url))
        return _factories[url]


@shared_task(name=RUN_JOB_TASK, bind=True, acks_late=True, reject_on_worker_lost=True)
def run_job(self: Task, job_id: int) -> str:
    settings: Settings = self.app.conf.tlt_settings
    worker = self.request.hostname or os.uname().nodename
    return JobSupervisor(settings, int(job_id), worker).run()


class JobSupervisor:
    """One delivery of one job on this worker."""

    def __init__(self, settings: Settings, job_id: int, worker: str) -> None:
        self.settings, self.job_id, self.worker = settings, job_id, worker
        self.sessions = session_factory(settings.database_url)
        self.cancel_requested_at: float | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=settings.log_tail_lines)
        self._stop = threading.Event()
        self._out_lock = threading.Lock()
        self._out_batch: list[str] = []
        self.attempt = 0  # set by claim()
        self.superseded_by: int | None = None  # the attempt that took the job over from this one

    # ------------------------------------------------------------ claim

    def run(self) -> str:
        claim = retry_transient(self.claim, for_s=DB_RETRY_S, what=f"job {self.job_id}: claim", log=log)
        if claim is None:
            return "skipped"
        attempt, resume = claim
        try:
            result = self.supervise(attempt, resume)
        except Exception as e:  # noqa: BLE001 - the supervisor itself failed (DB, fork): fail the attempt visibly
            log.exception("job %s: supervisor error", self.job_id)
            result = S.failed, f"worker error: {type(e).__name__}: {e}"
        if result is None:
            log.warning("job %s: attempt %s was taken over by attempt %s; its child was killed, no outcome written",
                        self.job_id, attempt, self.superseded_by)
            return "superseded"
        outcome, reason = result
        retry_transient(lambda: self.finish(outcome, reason), for_s=DB_RETRY_S, what=f"job {self.job_id}: finish",
                        log=log)
        return outcome.value

    def claim(self) -> tuple[int, bool] | None:
        """Move the job to starting (fresh) or recovering (its worker was lost). None: nothing to do here."""
        deadline = time.monotonic() + 2 * self.settings.heartbeat_timeout_s
        while True:
            with self.sessions() as s:
                try:
                    job = crud.get_job(s, None, self.job_id)
                except crud.NotFound:
                    log.warning("job %s does not exist; message dropped", self.job_id)
                    return None
                status = JobStatus(job.status)
                try:
                    if status in FINAL:
                        log.info("job %s already %s; duplicate delivery ignored", self.job_id, status)
                        return None
                    if status == S.queued:
                        job = crud.transition(s, self.job_id, S.starting, reason="picked up", worker=self.worker,
                                              expect=[S.queued], new_attempt=True)
                        self.attempt = job.attempt
                        self._beat()
                        # a job queued again by a retry (attempt > 1) resumes from its newest checkpoint
                        return job.attempt, job.attempt > 1
                    if status == S.cancelling:  # cancelled while its worker was lost
                        crud.transition(s, self.job_id, S.cancelled, reason="cancelled (no worker was running it)",
                                        expect=[S.cancelling])
                        return None
                    age = _age_s(job.heartbeat_at or job.updated_at)
                    if age > self.settings.heartbeat_timeout_s:
                        job = crud.transition(
                            s, self.job_id, S.recovering, worker=self.worker, expect=[status], new_attempt=True,
                            reason=f"worker {job.worker} lost (no heartbeat for {age:.0f} s); resuming",
                        )
                        self.attempt = job.attempt
                        self._beat()
                        return job.attempt, True
                except IllegalTransition:
                    continue  # changed under us (a cancel): look again
            if time.monotonic() > deadline:  # its worker is alive and still heartbeating: not ours
                with self.sessions() as s:
                    crud.add_event(s, self.job_id, f"duplicate delivery to {self.worker} ignored: "
                                   "the job's worker is alive", worker=self.worker)
                return None
            time.sleep(min(1.0, self.settings.heartbeat_s))

    # ------------------------------------------------------------ run the child

    def child_command(self, attempt: int, resume: bool) -> list[str]:
        cmd = [sys.executable, "-m", "worker.job_child", str(self.job_id), "--attempt", str(attempt),
               "--parent-pid", str(os.getpid())]
        return cmd + (["--resume"] if resume else [])

    def child_env(self, gpus: int) -> dict[str, str]:
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = assign_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
        env.update(TLT_DATABASE_URL=self.settings.database_url, TLT_BROKER_URL=self.settings.broker_url,
                   TLT_ARTIFACT_DIR=str(self.settings.artifacts), TLT_HOME=str(self.settings.home),
                   TLT_SPEC_ROOTS=self.settings.spec_roots,  # the child checks the spec's paths again
                   TLT_KEEP_LAST_CHECKPOINTS=str(self.settings.keep_last_checkpoints), PYTHONUNBUFFERED="1")
        return env

    def supervise(self, attempt: int, resume: bool) -> tuple[JobStatus, str] | None:
        """The attempt's outcome, or None when another attempt took the job over (nothing to write)."""
        with self.sessions() as s:
            gpus = int(crud.get_job(s, None, self.job_id).spec.get("resources", {}).get("gpus", 0))
        try:
            env = self.child_env(gpus)
        except ValueError as e:
            return S.failed, str(e)
        proc = subprocess.Popen(
            self.child_command(attempt, resume), env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True, errors="replace",
        )
        log.info("job %s attempt %s: child pid %s", self.job_id, attempt, proc.pid)
        try:
            return self._watch(proc, attempt, resume)
        finally:
            if proc.poll() is None:  # the supervisor itself failed: never leave a training process behind
                _killpg(proc.pid)
                proc.wait()

    def _watch(self, proc: subprocess.Popen[str], attempt: int, resume: bool) -> tuple[JobStatus, str] | None:
        threads = [threading.Thread(target=self._pump_output, args=(proc,), daemon=True),
                   threading.Thread(target=self._heartbeat_loop, args=(proc,), daemon=True)]
        for t in threads:
            t.start()
        try:
            with self.sessions() as s:
                crud.transition(s, self.job_id, S.running, worker=self.worker,
                                reason=f"attempt {attempt}{' (resumed)' if resume else ''}, child pid {proc.pid}",
                                expect=[S.starting, S.recovering])
        except IllegalTransition as e:  # cancelled while starting: the heartbeat loop sees `cancelling`
            log.info("job %s: not marked running: %s", self.job_id, e)
        killed = False
        while proc.poll() is None:  # a cancel: the child's reporter.should_stop() reads `cancelling` by itself
            if (self.cancel_requested_at is not None and not killed
                    and time.monotonic() - self.cancel_requested_at > self.settings.cancel_grace_s):
                log.warning("job %s: no stop after %.0f s grace; killing the child", self.job_id,
                            self.settings.cancel_grace_s)
                _killpg(proc.pid)
                killed = True
            self._flush_output(attempt)  # output reaches log_lines within ~0.5 s
            time.sleep(0.5)
        self._stop.set()
        threads[0].join(timeout=10)
        self._flush_output(attempt)
        if self.superseded_by is not None:
            return None
        rc = proc.returncode
        result = retry_transient(lambda: self.outcome(rc, killed), for_s=DB_RETRY_S, what=f"job {self.job_id}: outcome",
                                 log=log)
        self._flush_output(attempt)  # lines still pending from an outage
        return result

    def outcome(self, rc: int, killed_for_cancel: bool) -> tuple[JobStatus, str]:
        with self.sessions() as s:
            status = crud.job_status(s, self.job_id)
        if status == S.cancelling:
            how = ("hard-killed after the grace period" if killed_for_cancel
                   else "stopped at a safe point" if rc == 0 else f"training process ended with status {rc}")
            return S.cancelled, f"cancelled: {how}"
        if rc == 0:
            return S.succeeded, "finished"
        if rc < 0:
            name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
            why = f"training process killed by {name}" + (" (out of memory?)" if rc == -signal.SIGKILL else "")
        else:
            why = f"training process exited with status {rc}"
        # users get the error line; the traceback (server install paths) stays in the job's log, owner and admins only
        error = next((line.strip() for line in reversed(self.tail) if line.strip()), "")
        return S.failed, f"{why}: {error[:500]} (full output in the job's log)" if error else why

    def finish(self, outcome: JobStatus, reason: str) -> None:
        self._stop.set()
        with self.sessions() as s:
            try:
                crud.transition(s, self.job_id, outcome, reason=reason, worker=self.worker,
                                expect=[S.starting, S.running, S.recovering, S.cancelling])
            except IllegalTransition as e:
                log.warning("job %s: final transition to %s refused: %s", self.job_id, outcome, e)

    # ------------------------------------------------------------ threads

    def _beat(self) -> crud.Beat | None:
        with self.sessions() as s:
            return crud.heartbeat(s, self.job_id, self.attempt)

    def _heartbeat_loop(self, proc: subprocess.Popen[str]) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            try:
                beat = self._beat()
            except Exception:  # noqa: BLE001 - a transient DB error must not stop the heartbeats
                log.exception("job %s: heartbeat failed", self.job_id)
                continue
            if beat is None:
                continue
            if beat.attempt != self.attempt:  # presumed lost while the database was away: the job is not ours
                log.warning("job %s: attempt %s started elsewhere while this worker could not heartbeat; "
                            "killing attempt %s's child", self.job_id, beat.attempt, self.attempt)
                self.superseded_by = beat.attempt
                _killpg(proc.pid)
                return
            if beat.status == S.cancelling and self.cancel_requested_at is None:
                self.cancel_requested_at = time.monotonic()

    def _pump_output(self, proc: subprocess.Popen[str]) -> None:
        """Child stdout+stderr -> the failure tail and the pending batch of log lines."""
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            with self._out_lock:
                self.tail.append(line)
                self._out_batch.append(line)

    def _flush_output(self, attempt: int) -> None:
        with self._out_lock:
            lines, self._out_batch = self._out_batch, []
        if lines:
            try:
                with self.sessions() as s:
                    crud.add_logs(s, self.job_id, attempt, lines, stream="output")
                    s.commit()
            except Exception:  # noqa: BLE001 - the database is away: keep the lines (in order) for the next flush
                log.warning("job %s: could not store %d output lines yet", self.job_id, len(lines), exc_info=True)
                with self._out_lock:
                    self._out_batch[:0] = lines
                    del self._out_batch[:-MAX_PENDING_OUTPUT]


@worker_ready.connect
def start_sweeper(sender: object = None, **_: object) -> None:
    """When a worker is ready, register what it can run (admission reads it) and watch for jobs whose worker died
    without the broker redelivering them (the SQLite broker never does; Redis only after its visibility timeout):
    they are enqueued again, and `claim` resumes them. The same loop refreshes the registration."""
    app: Celery = getattr(sender, "app")  # noqa: B009 - the Consumer that sent the signal
    queues = list(app.amqp.queues.consume_from or app.amqp.queues)
    name = str(getattr(sender, "hostname", None) or os.uname().nodename)
    settings: Settings = app.conf.tlt_settings
    capacity = registry.probe(queues)
    with session_factory(settings.database_url)() as s:
        crud.register_worker(s, name, capacity)
    log.info("registered worker %s: %s", name, capacity)
    app.conf.tlt_worker_name = name
    threading.Thread(target=_sweep_loop, args=(app, settings, queues, name, capacity), name="tlt-sweeper",
                     daemon=True).start()


@worker_shutdown.connect
def unregister(sender: object = None, **_: object) -> None:
    """A worker that stops cleanly leaves the registry at once (a killed one ages out after worker_ttl_s)."""
    app: Celery | None = getattr(sender, "app", None)
    name = getattr(app.conf, "tlt_worker_name", None) if app is not None else None
    if app is None or name is None:
        return
    try:
        with session_factory(app.conf.tlt_settings.database_url)() as s:
            crud.unregister_worker(s, name)
    except Exception:  # noqa: BLE001 - shutting down: the row ages out anyway
        log.warning("could not unregister worker %s", name, exc_info=True)


def _sweep_loop(app: Celery, settings: Settings, queues: list[str], name: str, capacity: crud.Capacity) -> None:
    sessions = session_factory(settings.database_url)
    resent: dict[int, float] = {}
    while True:
        try:
            with sessions() as s:
                crud.beat_worker(s, name, capacity)
        except Exception:  # noqa: BLE001 - a database hiccup: the next beat comes within the TTL
            log.exception("worker heartbeat failed")
        try:
            with sessions() as s:
                stale = crud.stale_jobs(s, settings.heartbeat_timeout_s, queues)
            for job in stale:
                if time.monotonic() - resent.get(job.id, -1e9) < 10 * settings.heartbeat_timeout_s:
                    continue
                log.warning("job %s: worker %s stopped heartbeating; enqueueing it again", job.id, job.worker)
                app.send_task(RUN_JOB_TASK, args=[job.id], queue=job.queue)
                resent[job.id] = time.monotonic()
        except Exception:  # noqa: BLE001 - the sweeper must outlive a database or broker hiccup
            log.exception("stale-job sweep failed")
        time.sleep(min(settings.heartbeat_timeout_s, settings.worker_ttl_s) / 2)


def assign_gpus(visible: str | None, gpus: int) -> str:
    """CUDA_VISIBLE_DEVICES for a child that needs `gpus` GPUs, from the worker's own (None: not restricted).
    A CPU job sees no GPU; a GPU job gets the first `gpus` of the worker's devices (one job per worker at a time)."""
    if gpus == 0:
        return ""
    if visible is None:
        return ",".join(str(i) for i in range(gpus))
    devices = [d for d in visible.split(",") if d.strip()]
    if len(devices) < gpus:
        raise ValueError(f"the job needs {gpus} GPUs; this worker has {len(devices)} (CUDA_VISIBLE_DEVICES={visible!r})")
    return ",".join(devices[:gpus])


def _age_s(ts: datetime | None) -> float:
    if ts is None:
        return float("inf")
    ts = ts if ts.tzinfo else ts.replace(tzinfo=UTC)
    return (datetime.now(UTC) - ts).total_seconds()


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
