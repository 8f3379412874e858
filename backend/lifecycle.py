"""The job lifecycle: statuses and the one table of legal transitions (API and worker both go through
`check_transition`, via `crud.transition`).

    queued -> starting -> running -> succeeded | failed
                  |          |  \\-> recovering -> running          (worker lost: requeued, resumes from checkpoint)
                  \\----------+----> cancelling -> cancelled | failed | succeeded
    queued -> cancelled (cancel before a worker took it);  failed | cancelled -> queued (retry)
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    queued = "queued"
    starting = "starting"
    running = "running"
    recovering = "recovering"
    cancelling = "cancelling"
    cancelled = "cancelled"
    succeeded = "succeeded"
    failed = "failed"


S = JobStatus
TERMINAL = frozenset({S.cancelled, S.succeeded, S.failed})
FINAL = TERMINAL  # the name backend/persistence/crud/ uses
ACTIVE = frozenset({S.starting, S.running, S.recovering, S.cancelling})  # a worker owns the job

ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    S.queued: frozenset({S.starting, S.cancelled, S.failed}),  # failed: could not be enqueued
    S.starting: frozenset({S.running, S.recovering, S.cancelling, S.failed}),
    S.running: frozenset({S.succeeded, S.failed, S.recovering, S.cancelling}),
    S.recovering: frozenset({S.running, S.recovering, S.cancelling, S.cancelled, S.failed}),
    S.cancelling: frozenset({S.cancelled, S.failed, S.succeeded}),
    S.cancelled: frozenset({S.queued}),
    S.failed: frozenset({S.queued}),
    S.succeeded: frozenset(),
}


class IllegalTransition(ValueError):
    def __init__(self, job_id: int, current: JobStatus | str, target: JobStatus | str) -> None:
        super().__init__(f"job {job_id}: a {current} job cannot become {target}")
        self.job_id, self.current, self.target = job_id, current, target


def check(job_id: int, current: JobStatus | str, target: JobStatus | str) -> None:
    """Raise IllegalTransition unless `current -> target` is in ALLOWED."""
    if JobStatus(target) not in ALLOWED[JobStatus(current)]:
        raise IllegalTransition(job_id, current, target)
