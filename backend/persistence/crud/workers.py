"""The worker registry: each Celery worker upserts its row (queues, GPUs, memory) at start and on every beat;
admission reads the live ones (beat within `ttl_s`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from backend.persistence.crud.common import _insert
from backend.persistence.models import Worker, utcnow


@dataclass(frozen=True)
class Capacity:
    """What one worker can give one job."""

    queues: list[str]
    gpus: int = 0
    gpu_memory_gb: float = 0.0  # the smallest of its GPUs
    host_memory_gb: float = 0.0
    cuda: str | None = None


def register_worker(session: Session, name: str, cap: Capacity) -> None:
    """Insert or refresh `name`'s row (its capacity may change between starts)."""
    now = utcnow()
    values = dict(queues=sorted(set(cap.queues)), gpus=cap.gpus, gpu_memory_gb=cap.gpu_memory_gb,
                  host_memory_gb=cap.host_memory_gb, cuda=cap.cuda, heartbeat_at=now)
    stmt = _insert(session, Worker).values(name=name, started_at=now, **values)
    session.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={**values, "started_at": now}))
    session.commit()


def beat_worker(session: Session, name: str, cap: Capacity) -> None:
    """A worker's heartbeat; re-inserts the row if an operator removed it."""
    row = session.scalar(select(Worker).where(Worker.name == name))
    if row is None:
        register_worker(session, name, cap)
        return
    row.heartbeat_at = utcnow()
    session.commit()


def unregister_worker(session: Session, name: str) -> None:
    session.execute(delete(Worker).where(Worker.name == name))
    session.commit()


def live_workers(session: Session, ttl_s: float) -> Sequence[Worker]:
    cutoff = utcnow() - timedelta(seconds=ttl_s)
    return session.scalars(select(Worker).where(Worker.heartbeat_at >= cutoff).order_by(Worker.name)).all()
