"""The runner interface between the job plumbing and the training library: `execute(spec, run_dir, reporter, resume)`.

The worker's child process (worker/job_child.py) calls it with a DbReporter; `tlt train spec.yaml` runs the same loop
without the service. Everything a job does is `worker.tlt.train.run`; this module only prepares the run directory and
imports the library lazily (torch is imported in the child, never in the Celery worker process).
"""

from __future__ import annotations

import logging
from pathlib import Path

from worker.tlt.config import JobSpec
from worker.tlt.reporting import Reporter

log = logging.getLogger(__name__)


def execute(spec: JobSpec, run_dir: Path, reporter: Reporter, resume: bool) -> None:
    """Run one job to completion (or to a cooperative stop when reporter.should_stop()). Raises on failure."""
    run_dir.mkdir(parents=True, exist_ok=True)
    from worker.tlt.train import run  # the training loop (torch): imported here, in the child process only

    log.info("running %r (%s) in %s%s", spec.name, spec.type, run_dir, " (resume)" if resume else "")
    run(spec, run_dir, reporter, resume)
