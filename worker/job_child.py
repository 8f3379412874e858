"""The child process that runs one attempt of one job: `python -m worker.job_child JOB_ID --attempt N [--resume]`.

Started by the `run_job` task (worker/tasks.py) in its own process group; reads the job row and settings (TLT_* env
passed by the parent), refuses paths outside TLT_SPEC_ROOTS (and installs the guard that judges each file the loaders
open: worker/tlt/file_guard.py), resolves uploaded dataset and artifact ids to their
files (reads retried over a database restart: backend.persistence.db.retry_transient), and calls `worker.runner.execute`
with a DbReporter. Exit status 0 = the loop returned (finished, or stopped on cancel); anything else = the attempt
failed (the traceback goes to stderr, which the parent keeps as the job's last output lines).
If the parent worker dies, the kernel kills this process (PR_SET_PDEATHSIG) so a lost job never runs twice.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from backend.core.config import get_settings
from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory, retry_transient
from backend.worker_spec import job_file_guard, runnable_spec
from worker import runner
from worker.db_reporter import DbReporter
from worker.tlt import file_guard
from worker.tlt.config import JobSpec

log = logging.getLogger("worker.job_child")
PR_SET_PDEATHSIG = 1
STARTUP_RETRY_S = 300.0  # the start-up reads wait this long for a restarting database (as the supervisor's writes)


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when the worker that started us exits; exit now if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid and os.getppid() != parent_pid:
        os._exit(70)


def read_spec(sessions, job_id: int, retry_s: float = STARTUP_RETRY_S) -> JobSpec:  # type: ignore[no-untyped-def]
    """The job's spec as the library runs it (backend/worker_spec.py: paths checked against this worker's
    TLT_SPEC_ROOTS, uploaded dataset and artifact ids resolved with the owner's rights): the start-up reads, retried
    together while the database is away (a restart), for up to `retry_s`."""

    def read() -> JobSpec:
        with sessions() as s:
            return runnable_spec(s, crud.get_job(s, None, job_id), get_settings())

    return retry_transient(read, for_s=retry_s, what=f"job {job_id}: read its spec", log=log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.job_child", description=__doc__)
    ap.add_argument("job_id", type=int)
    ap.add_argument("--attempt", type=int, required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--parent-pid", type=int, default=0)
    args = ap.parse_args(argv)
    die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    settings = get_settings()
    sessions = make_session_factory(make_engine(settings.database_url))
    spec = read_spec(sessions, args.job_id)
    file_guard.install(job_file_guard(spec, settings))  # every file a loader opens for the spec is judged on its own
    run_dir = settings.artifacts / "jobs" / str(args.job_id)
    reporter = DbReporter(sessions, args.job_id, args.attempt, settings.artifacts)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a polite SIGTERM (an operator) stops at the next safe point
    reporter.add_stop_event(stop)
    try:
        runner.execute(spec, Path(run_dir), reporter, args.resume)
    finally:
        reporter.close()
    log.info("job %s attempt %s: training loop returned%s", args.job_id, args.attempt,
             " (stopped on cancel)" if reporter.should_stop() else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
