"""What the API shows of jobs: JobPublic's fields and each job's progress as plain dicts, read with one Core query per
page or job (no ORM objects), by statements built once per filter combination.

Why not ORM rows plus a progress query: on SQLite that was most of a list request's CPU (ORM identity-map loading
of every row and its joined owner, building the select, a second statement for the progress). Ownership is the same
as crud.get_job: users see their own jobs, admins everyone's.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import Select, bindparam, select
from sqlalchemy.orm import Session

from backend.persistence.crud.common import NotFound
from backend.persistence.crud.jobs import decode_cursor, encode_cursor
from backend.persistence.crud.telemetry import LAST_STEP, LAST_STEP_TIME, finite_or_none
from backend.persistence.models import Job, User

_VIEW = select(
    Job.id, Job.name, User.name.label("owner"), Job.status, Job.reason, Job.attempt, Job.worker, Job.queue, Job.spec,
    Job.idempotency_key, Job.created_at, Job.updated_at, Job.started_at, Job.finished_at, Job.heartbeat_at,
    LAST_STEP, LAST_STEP_TIME,
).join(User, User.id == Job.owner_id)


@cache
def _list_stmt(admin: bool, status: bool, owner: bool, cursor: bool) -> Select:
    """Newest first, at most :limit rows; the flags say which filters (bound parameters) apply."""
    stmt = _VIEW if admin else _VIEW.where(Job.owner_id == bindparam("user_id"))
    if status:
        stmt = stmt.where(Job.status == bindparam("status"))
    if owner:
        stmt = stmt.where(User.name == bindparam("owner"))
    if cursor:
        stmt = stmt.where(Job.id < bindparam("before_id"))
    return stmt.order_by(Job.id.desc()).limit(bindparam("limit"))


_BY_ID = _VIEW.where(Job.id == bindparam("job_id"))
_OWN_BY_ID = _BY_ID.where(Job.owner_id == bindparam("user_id"))


def _view(row: Any) -> dict[str, Any]:
    view = dict(row._mapping)
    view["last_step_time_s"] = finite_or_none(view["last_step_time_s"])
    return view


def job_view(session: Session, user: User | None, job_id: int) -> dict[str, Any]:
    """The job's view if `user` may see it (user None = internal caller), else NotFound."""
    stmt = _BY_ID if user is None or user.is_admin else _OWN_BY_ID
    row = session.execute(stmt, {"job_id": job_id, "user_id": None if user is None else user.id}).first()
    if row is None:
        raise NotFound(f"job {job_id} not found")
    return _view(row)


def list_jobs(
    session: Session, user: User, *, status: str | None = None, owner: str | None = None,
    cursor: str | None = None, limit: int = 50,
) -> tuple[list[dict[str, Any]], str | None]:
    """Job views, newest first, and the next page's cursor (None on the last page). `cursor` is opaque (the previous
    page's next_cursor); a malformed one raises ValueError."""
    params = {"user_id": user.id, "status": status, "owner": owner, "limit": limit + 1,
              "before_id": decode_cursor(cursor) if cursor else None}
    rows = session.execute(_list_stmt(user.is_admin, bool(status), bool(owner), bool(cursor)), params).all()
    views = [_view(r) for r in rows[:limit]]
    return views, (encode_cursor(views[-1]["id"]) if len(rows) > limit else None)
