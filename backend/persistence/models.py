"""SQLAlchemy 2 ORM models of the control plane. The schema is created and changed only by Alembic
(migrations/versions/); keep the two in step (tests/backend/test_cp_migrations.py compares them)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware everywhere: stored as DateTime(timezone=True); SQLite returns naive values, read back as UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


# BigInteger ids on Postgres, INTEGER (the rowid alias, so autoincrement works) on SQLite.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    is_admin: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ApiToken(Base):
    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100), default="")
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex; the token itself is never stored
    prefix: Mapped[str] = mapped_column(String(12))  # first characters, to recognise a token in a list
    # the token acts as an admin only when this is set AND its user is an admin: a token made without --admin for an
    # admin user is an ordinary user's token (least privilege)
    admin: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    user: Mapped[User] = relationship(lazy="joined")

    @property
    def user_name(self) -> str:
        return self.user.name

    @property
    def fingerprint(self) -> str:
        """What a listing shows to recognise a token: the scheme prefix and the start of its hash, no character of
        the secret (the holder of a token can compute it: sha256 of the token)."""
        return f"tlt_…{self.token_hash[:8]}"


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("owner_id", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        Index("ix_jobs_status_id", "status", "id"),
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)  # worker.tlt.config.JobSpec, validated, defaults filled
    queue: Mapped[str] = mapped_column(String(50))
    status: Mapped[str] = mapped_column(String(20), default="queued")
    reason: Mapped[str | None] = mapped_column(Text)  # why the last transition happened (failure text, ...)
    attempt: Mapped[int] = mapped_column(default=0)  # incremented each time a worker starts or resumes the job
    worker: Mapped[str | None] = mapped_column(String(255))  # hostname of the worker running the current attempt
    child_pid: Mapped[int | None] = mapped_column()  # process id of the training child on that worker
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    owner: Mapped[User] = relationship(lazy="joined")

    @property
    def owner_name(self) -> str:
        return self.owner.name


class JobEvent(Base):
    """One row per lifecycle transition (kind "transition"), plus notes such as an ignored duplicate delivery
    (kind "info", from_status = to_status = the status at the time)."""

    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)  # SSE: a job's rows after a cursor
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    from_status: Mapped[str | None] = mapped_column(String(20))
    to_status: Mapped[str] = mapped_column(String(20))
    kind: Mapped[str] = mapped_column(String(20), default="transition")  # transition | info
    reason: Mapped[str | None] = mapped_column(Text)
    worker: Mapped[str | None] = mapped_column(String(255))
    attempt: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Metric(Base):
    __tablename__ = "metrics"
    __table_args__ = (
        UniqueConstraint("job_id", "step", "name", name="uq_metrics_job_step_name"),  # also: a job's last step
        Index("ix_metrics_job_id_id", "job_id", "id"),  # SSE: rows after a cursor; the cursor itself (max id)
        Index("ix_metrics_job_name_step", "job_id", "name", "step"),  # one series by step; latest timing_s/step
    )
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column()
    name: Mapped[str] = mapped_column(String(200))
    value: Mapped[float | None] = mapped_column(Float)  # NULL = not finite (NaN/inf: SQLite cannot store NaN)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Histogram(Base):
    __tablename__ = "histograms"
    __table_args__ = (UniqueConstraint("job_id", "step", "name", name="uq_histograms_job_step_name"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column()
    name: Mapped[str] = mapped_column(String(200))
    edges: Mapped[list[float]] = mapped_column(JSON)  # len(counts) + 1 bin edges
    counts: Mapped[list[int]] = mapped_column(JSON)


class LogLine(Base):
    __tablename__ = "log_lines"
    __table_args__ = (Index("ix_log_lines_job_id_id", "job_id", "id"),)  # SSE and `tlt logs`: rows after a cursor
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(default=0)
    stream: Mapped[str] = mapped_column(String(10), default="log")  # log (reporter) | output (child stdout/err)
    line: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class JobSample(Base):
    """A few (prompt, response, reward) rows per step for the dashboard."""

    __tablename__ = "job_samples"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column()
    data: Mapped[dict[str, Any]] = mapped_column(JSON)  # {"rows": [{prompt, response, reward, ...}]}
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    @property
    def rows(self) -> list[dict[str, Any]]:
        return list(self.data.get("rows", []))


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "path", name="uq_artifacts_job_path"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(20))  # policy | drafter | checkpoint | tensorboard
    step: Mapped[int | None] = mapped_column()
    path: Mapped[str] = mapped_column(Text)  # absolute path on the shared artifact store
    is_dir: Mapped[bool] = mapped_column(default=False)
    size: Mapped[int] = mapped_column(BigInteger)  # bytes served by a download (the tar stream for a directory)
    sha256: Mapped[str] = mapped_column(String(64))  # of the bytes served by a download
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime())  # retention removed it

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def download_url(self) -> str:
        return f"/api/v1/artifacts/{self.id}/download"


class Dataset(Base):
    __tablename__ = "datasets"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # "ds_" + hex; what JobSpec.dataset.dataset_id names
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    format: Mapped[str] = mapped_column(String(10))  # jsonl | parquet
    path: Mapped[str] = mapped_column(Text)
    num_rows: Mapped[int] = mapped_column()
    columns: Mapped[list[str]] = mapped_column(JSON)
    prompt_column: Mapped[str] = mapped_column(String(100))
    answer_column: Mapped[str] = mapped_column(String(100))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Worker(Base):
    """A Celery worker that can run jobs: what it consumes and has, refreshed by its heartbeat. Admission
    (backend/admission.py) refuses a spec that no live worker could run."""

    __tablename__ = "workers"
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)  # the Celery node name, e.g. gpu@host
    queues: Mapped[list[str]] = mapped_column(JSON)  # the queues it consumes
    gpus: Mapped[int] = mapped_column(default=0)  # GPUs it may hand to one job
    gpu_memory_gb: Mapped[float] = mapped_column(Float, default=0.0)  # memory of its smallest GPU (0 = no GPU)
    host_memory_gb: Mapped[float] = mapped_column(Float, default=0.0)  # RAM (what a CPU job's KV cache lives in)
    cuda: Mapped[str | None] = mapped_column(String(50))  # driver's CUDA version; None without a GPU
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
