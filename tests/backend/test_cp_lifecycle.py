"""The lifecycle table and crud.transition: legal moves write one event with worker and attempt; illegal or stale
(compare-and-set lost) moves raise and leave no row behind."""

from __future__ import annotations

import pytest

from backend import lifecycle
from backend.lifecycle import ALLOWED, FINAL, JobStatus
from backend.persistence import crud
from worker.tlt.config import JobSpec

S = JobStatus


def test_table_shape() -> None:
    assert set(ALLOWED) == set(JobStatus)
    assert ALLOWED[S.succeeded] == frozenset()
    for final in FINAL - {S.succeeded}:
        assert ALLOWED[final] == {S.queued}  # only retry leaves a final state
    with pytest.raises(lifecycle.IllegalTransition, match="cannot become"):
        lifecycle.check(1, S.queued, S.succeeded)


def test_transition_full_path_and_cas(cp_backend) -> None:
    with cp_backend.session() as s:
        owner = crud.get_or_create_user(s, "alice")
        job, created = crud.create_job(s, owner, JobSpec.model_validate({"model": {"builtin": "tiny-llama"}}), None)
        assert created
        crud.transition(s, job.id, S.starting, worker="host-a", new_attempt=True)
        crud.transition(s, job.id, S.running)
        crud.transition(s, job.id, S.recovering, reason="worker host-a lost")
        crud.transition(s, job.id, S.running, worker="host-b", new_attempt=True)
        with pytest.raises(lifecycle.IllegalTransition):
            crud.transition(s, job.id, S.queued)  # running -> queued is not a move
        with pytest.raises(lifecycle.IllegalTransition):
            crud.transition(s, job.id, S.succeeded, expect=[S.cancelling])  # the status is not what we expected
        final = crud.transition(s, job.id, S.succeeded, reason="done")
        assert final.finished_at is not None and final.started_at is not None and final.attempt == 2
        events = crud.list_events(s, job.id)
    assert [(e.from_status, e.to_status, e.worker, e.attempt) for e in events] == [
        (None, "queued", None, 0), ("queued", "starting", "host-a", 1), ("starting", "running", "host-a", 1),
        ("running", "recovering", "host-a", 1), ("recovering", "running", "host-b", 2),
        ("running", "succeeded", "host-b", 2),
    ]


def test_concurrent_transition_one_wins(cp_backend) -> None:
    """Two sessions read `running`; the first commit wins, the second gets IllegalTransition (no second event)."""
    with cp_backend.session() as s:
        owner = crud.get_or_create_user(s, "alice")
        job, _ = crud.create_job(s, owner, JobSpec.model_validate({"model": {"builtin": "tiny-llama"}}), None)
        crud.transition(s, job.id, S.starting, worker="w", new_attempt=True)
        crud.transition(s, job.id, S.running)
    with cp_backend.session() as a, cp_backend.session() as b:
        assert crud.get_job(a, None, job.id).status == crud.get_job(b, None, job.id).status == "running"
        crud.transition(a, job.id, S.cancelling, reason="user")
        with pytest.raises(lifecycle.IllegalTransition):
            crud.transition(b, job.id, S.succeeded, expect=[S.running])
        assert [e.to_status for e in crud.list_events(b, job.id)][-1] == "cancelling"
