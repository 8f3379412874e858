"""Artifacts (registered by the worker, soft-deleted by retention, downloaded with ownership checked) and datasets."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from backend.lifecycle import FINAL, JobStatus
from backend.persistence.crud.common import NotFound, _insert
from backend.persistence.crud.jobs import get_job
from backend.persistence.models import Artifact, Dataset, Job, User, utcnow


def register_artifact(
    session: Session, job_id: int, *, kind: str, path: str, is_dir: bool, size: int, sha256: str, step: int | None
) -> None:
    """Upsert on (job, path): registering the same export twice updates it (and clears deleted_at)."""
    stmt = _insert(session, Artifact).values(
        job_id=job_id, kind=kind, path=path, is_dir=is_dir, size=size, sha256=sha256, step=step, created_at=utcnow()
    )
    session.execute(stmt.on_conflict_do_update(
        index_elements=["job_id", "path"],
        set_={"size": stmt.excluded.size, "sha256": stmt.excluded.sha256, "step": stmt.excluded.step,
              "is_dir": stmt.excluded.is_dir, "kind": stmt.excluded.kind, "deleted_at": None},
    ))


def mark_artifacts_deleted(session: Session, artifact_ids: Sequence[int]) -> None:
    """Retention removed these files: the rows stay (history) with deleted_at set; downloads answer 410."""
    if artifact_ids:
        stmt = update(Artifact).where(Artifact.id.in_(list(artifact_ids)), Artifact.deleted_at.is_(None))
        session.execute(stmt.values(deleted_at=utcnow()))


def list_artifacts(session: Session, job_id: int, kind: str | None = None) -> Sequence[Artifact]:
    stmt = select(Artifact).where(Artifact.job_id == job_id)
    if kind:
        stmt = stmt.where(Artifact.kind == kind)
    return session.scalars(stmt.order_by(Artifact.id)).all()


def get_artifact(session: Session, user: User, artifact_id: int) -> Artifact:
    """The artifact, if `user` may see its job; else NotFound with the same text as a missing id (nothing tells
    another user's artifact from no artifact)."""
    art = session.get(Artifact, artifact_id)
    try:
        if art is not None:
            get_job(session, user, art.job_id)  # ownership
    except NotFound:
        art = None
    if art is None:
        raise NotFound(f"artifact {artifact_id} not found")
    return art


def user_artifact_bytes(session: Session, user: User) -> int:
    """Bytes of the live (not retention-deleted) artifacts of `user`'s jobs: what the quota counts."""
    stmt = (select(func.coalesce(func.sum(Artifact.size), 0)).join(Job, Job.id == Artifact.job_id)
            .where(Job.owner_id == user.id, Artifact.deleted_at.is_(None)))
    return int(session.scalar(stmt) or 0)


def user_dataset_bytes(session: Session, user: User) -> int:
    """Bytes of `user`'s uploaded datasets (the quota counts them with the artifacts)."""
    stmt = select(func.coalesce(func.sum(Dataset.size), 0)).where(Dataset.owner_id == user.id)
    return int(session.scalar(stmt) or 0)


def jobs_using_dataset(session: Session, ds: Dataset) -> list[int]:
    """Ids of the queued or running jobs (not final) whose spec names the dataset by id."""
    live = [s.value for s in JobStatus if s not in FINAL]
    stmt = select(Job.id, Job.spec).where(Job.owner_id == ds.owner_id, Job.status.in_(live))
    return [jid for jid, spec in session.execute(stmt) if (spec.get("dataset") or {}).get("dataset_id") == ds.id]


def delete_dataset(session: Session, ds: Dataset) -> None:
    session.delete(ds)
    session.commit()


def create_dataset(session: Session, owner: User, **fields: Any) -> Dataset:
    ds = Dataset(id="ds_" + uuid.uuid4().hex[:16], owner_id=owner.id, **fields)
    session.add(ds)
    session.commit()
    return ds


def list_datasets(session: Session, user: User) -> Sequence[Dataset]:
    stmt = select(Dataset)
    if not user.is_admin:
        stmt = stmt.where(Dataset.owner_id == user.id)
    return session.scalars(stmt.order_by(Dataset.id.desc())).all()


def get_dataset(session: Session, user: User | None, dataset_id: str) -> Dataset:
    ds = session.get(Dataset, dataset_id)
    if ds is None or (user is not None and not user.is_admin and ds.owner_id != user.id):
        raise NotFound(f"dataset {dataset_id} not found")
    return ds
