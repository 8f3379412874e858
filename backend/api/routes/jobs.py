"""Jobs: create (Idempotency-Key), list (status/owner filters, cursor pagination), get, cancel, retry."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from backend import admission
from backend.api.deps import CurrentUser, DispatcherDep, JobId, SessionDep, SettingsDep, SubmitAllowed
from backend.core.dispatch import EnqueueError
from backend.lifecycle import JobStatus
from backend.persistence import crud
from backend.persistence.models import Job, User
from backend.schemas import JobCreate, JobPublic, Page, errors
from backend.user_limits import check_queued_jobs
from worker.tlt.config import JobSpec

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=errors(404, 409, 429, 503))


def _public(session: SessionDep, job_id: int) -> JobPublic:
    """The job as the API shows it (with its progress), read after a write: one query."""
    return JobPublic.model_validate(crud.job_view(session, None, job_id))


def _admit(session: SessionDep, owner: User, spec: JobSpec, settings: SettingsDep) -> None:
    """What a job must pass before it is queued, by a submit or a retry alike: admission (422/404/409) and the
    owner's queued-job cap (429)."""
    try:
        admission.admit(session, owner, spec, settings)
    except admission.Refused as e:
        raise RequestValidationError([e.as_error()]) from None
    check_queued_jobs(session, owner, settings)


def _enqueue(session: SessionDep, dispatcher: DispatcherDep, job: Job) -> None:
    """After commit. A broker failure fails the job (with the reason) instead of leaving it queued forever."""
    try:
        dispatcher.enqueue(job.id, job.queue)
    except EnqueueError as e:
        crud.transition(session, job.id, JobStatus.failed, reason=str(e), expect=[JobStatus.queued])
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"job {job.id} could not be enqueued: {e}") from e


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic, dependencies=[SubmitAllowed],
             responses={200: {"model": JobPublic, "description": "the job this Idempotency-Key already created"}})
def create_job(
    body: JobCreate, session: SessionDep, user: CurrentUser, dispatcher: DispatcherDep, settings: SettingsDep,
    response: Response,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=200)] = None,
) -> JobPublic:
    """Submit a job. The same Idempotency-Key from the same user returns the first job (200) instead of a new one.
    Refused before anything is stored (backend/admission.py): a path outside TLT_SPEC_ROOTS, a model or length no
    worker could run (422); someone else's artifact (404, as a missing one); the user's artifact quota used (409);
    the user's queued jobs at TLT_MAX_QUEUED_JOBS_PER_USER (429)."""
    replay = idempotency_key and crud.job_by_idempotency_key(session, user, idempotency_key)
    if not replay:  # a replay answers with the job already admitted (or 409 for a different spec)
        _admit(session, user, body.spec, settings)
    job, created = crud.create_job(session, user, body.spec, idempotency_key)
    if created:
        _enqueue(session, dispatcher, job)
    else:
        response.status_code = status.HTTP_200_OK
    return _public(session, job.id)


@router.get("", response_model=Page[JobPublic])
def list_jobs(
    session: SessionDep, user: CurrentUser, settings: SettingsDep,
    status_: Annotated[JobStatus | None, Query(alias="status")] = None,
    owner: Annotated[str | None, Query(max_length=100)] = None,
    cursor: Annotated[str | None, Query(max_length=100)] = None,
    limit: Annotated[int, Query(ge=1)] = 50,
) -> Page[JobPublic]:
    """Newest first; users see their own jobs, admins everyone's (filter with `owner`)."""
    try:
        views, nxt = crud.list_jobs(session, user, status=status_, owner=owner, cursor=cursor,
                                    limit=min(limit, settings.page_size_max))
    except ValueError as e:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(e)) from e
    return Page[JobPublic](items=[JobPublic.model_validate(v) for v in views], next_cursor=nxt)


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: JobId, session: SessionDep, user: CurrentUser) -> JobPublic:
    return JobPublic.model_validate(crud.job_view(session, user, job_id))


@router.post("/{job_id}/cancel", response_model=JobPublic)
def cancel_job(job_id: JobId, session: SessionDep, user: CurrentUser) -> JobPublic:
    """queued -> cancelled at once; a running job -> cancelling (the worker stops it at its next safe point and
    kills it after the grace period)."""
    job = crud.get_job(session, user, job_id)
    if job.status != JobStatus.cancelling:  # cancelling twice is not an error
        job = crud.request_cancel(session, job, reason=f"cancelled by {user.name}")
    return _public(session, job.id)


@router.post("/{job_id}/retry", response_model=JobPublic, dependencies=[SubmitAllowed])
def retry_job(
    job_id: JobId, session: SessionDep, user: CurrentUser, dispatcher: DispatcherDep, settings: SettingsDep,
) -> JobPublic:
    """A failed or cancelled job goes back to queued (its attempt counter continues; it resumes from a checkpoint).
    A retry queues a job as a submit does, so it passes the same rate limit, admission, quota and queued-job cap
    (the cap and the quota are the owner's: an admin retrying someone's job spends that user's allowance)."""
    job = crud.get_job(session, user, job_id)
    if job.status in (JobStatus.failed, JobStatus.cancelled):  # else the transition below answers 409
        try:
            spec = JobSpec.model_validate(job.spec)
        except ValidationError as e:
            raise crud.Conflict(f"job {job.id}'s spec is no longer valid, submit a new job: "
                                f"{e.errors()[0]['msg']}") from None
        _admit(session, user if job.owner_id == user.id else job.owner, spec, settings)  # the caller's token role
    job = crud.retry_job(session, job)
    _enqueue(session, dispatcher, job)
    return _public(session, job.id)
