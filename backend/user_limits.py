"""Per-user caps that hold however many tokens a user mints: jobs waiting in `queued` (TLT_MAX_QUEUED_JOBS_PER_USER,
429) and live API tokens (TLT_MAX_TOKENS_PER_USER, 409). The submit rate limit (backend/core/limits.py) is keyed by
user for the same reason. 0 turns a cap off.

    check_queued_jobs(session, owner, settings)      # before a submit or retry queues a job
    check_live_tokens(session, user_name, settings)  # before a token is created
"""

from __future__ import annotations

from fastapi import HTTPException, status
from sqlalchemy.orm import Session

from backend.core.config import Settings
from backend.lifecycle import JobStatus
from backend.persistence import crud
from backend.persistence.models import User


def check_queued_jobs(session: Session, owner: User, settings: Settings) -> None:
    """429 when `owner` already has the most queued jobs allowed (a queue flooded by one user delays everyone)."""
    cap = settings.max_queued_jobs_per_user
    if cap <= 0:
        return
    queued = crud.count_jobs_by_status(session, owner).get(JobStatus.queued, 0)
    if queued >= cap:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS,
                            f"queued job limit: {owner.name} has {queued} queued job(s), the most allowed is {cap} "
                            "(TLT_MAX_QUEUED_JOBS_PER_USER); wait for some to start or cancel them",
                            headers={"Retry-After": "30"})


def check_live_tokens(session: Session, user_name: str, settings: Settings) -> None:
    """409 when `user_name` already holds the most live tokens allowed; revoking one makes room."""
    cap = settings.max_tokens_per_user
    if cap <= 0:
        return
    live = crud.count_live_tokens(session, user_name)
    if live >= cap:
        raise crud.Conflict(f"token limit: {user_name} has {live} live token(s), the most allowed is {cap} "
                            "(TLT_MAX_TOKENS_PER_USER); revoke one first (DELETE /api/v1/tokens/{id})")
