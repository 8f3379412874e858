"""Input and output schemas of the REST API, separate from the SQLAlchemy models (backend/persistence/models.py).

The job spec itself is `worker.tlt.config.JobSpec`, owned by the training library; the API validates with it, so an
invalid spec is a 422 whose `loc` names the field (e.g. ["body", "spec", "algorithm", "learning_rate"]).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from worker.tlt.config import JobSpec

T = TypeVar("T")


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True, populate_by_name=True)


class ErrorDetail(BaseModel):
    """Every error response: `detail` is a message, or (422) a list of {loc, msg, type} / a {message, errors} report."""

    detail: Any


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error codes (all share ErrorDetail)."""
    return {code: {"model": ErrorDetail, "description": ERROR_TEXT.get(code, "error")} for code in codes}


ERROR_TEXT = {
    400: "bad request (e.g. a malformed cursor)", 401: "missing, invalid or revoked token",
    403: "admin token required", 404: "not found (or not yours)", 409: "conflict with the current state",
    410: "gone (deleted by retention)", 413: "request body or upload too large", 415: "unsupported file type",
    416: "range not satisfiable", 422: "invalid input", 429: "too many submissions (see Retry-After)",
    503: "broker unavailable",
}


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = None  # pass back as ?cursor= for the next page; None on the last page


def _lone_surrogate(value: Any, depth: int = 0) -> bool:
    """True when a string anywhere in `value` holds a lone UTF-16 surrogate (JSON "\\ud800" parses to one): no
    database can store it, and no response can echo it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if depth > 64:
        return False  # deeper than any valid body; the model's own validation refuses it
    if isinstance(value, dict):
        return any(_lone_surrogate(k, depth + 1) or _lone_surrogate(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return any(_lone_surrogate(v, depth + 1) for v in value)
    return False


class _Input(BaseModel):
    """A request body: unknown keys and invalid unicode are a 422."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if _lone_surrogate(data):
            raise ValueError("text must be valid unicode (a lone surrogate such as \\ud800 is not)")
        return data


class JobCreate(_Input):
    spec: JobSpec


class JobPublic(_Out):
    id: int
    name: str
    owner: str = Field(validation_alias="owner_name")
    status: str
    reason: str | None
    attempt: int
    worker: str | None
    queue: str
    spec: dict[str, Any]
    idempotency_key: str | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None
    last_step: int | None = None  # the newest step with metrics; null before the first
    last_step_time_s: float | None = None  # timing_s/step of the newest step that has it (normally last_step)


class EventPublic(_Out):
    id: int
    job_id: int
    created_at: datetime
    kind: str  # transition | info
    from_status: str | None
    to_status: str
    reason: str | None
    worker: str | None
    attempt: int


class MetricInfo(BaseModel):
    """One entry of the metric catalogue (worker/tlt/metric_catalog.py)."""

    name: str  # literal, or a template whose {field} parts stand for one path segment
    unit: str  # "fraction": a value in [0, 1]
    kind: Literal["per-step", "cumulative", "histogram"]
    meaning: str


class MetricPoint(BaseModel):
    step: int
    value: float | None  # null for NaN / infinity


class MetricSeries(BaseModel):
    name: str
    points: list[MetricPoint]
    total: int  # points stored after `after_step`, before downsampling


class MetricHistory(BaseModel):
    series: list[MetricSeries]
    last_step: int | None  # pass as ?after_step= to fetch only newer points
    # SSE cursor "M.0.0" (GET /stream's Last-Event-ID): M = the job's newest metric row when this history was read,
    # events and logs from their start (this response has none). Resuming the stream from it skips the metric rows
    # already reflected here; one committed during the query may come in both (same step, same value).
    stream_cursor: str


class HistogramPublic(_Out):
    step: int
    name: str
    edges: list[float]
    counts: list[int]


class LogLinePublic(_Out):
    id: int
    created_at: datetime
    attempt: int
    stream: str  # log (the training loop) | output (the child process's stdout/stderr)
    line: str


class SamplePublic(_Out):
    id: int
    step: int
    rows: list[dict[str, Any]]


class ArtifactPublic(_Out):
    id: int
    job_id: int
    kind: str
    name: str
    is_dir: bool
    size: int
    sha256: str
    step: int | None
    created_at: datetime
    deleted_at: datetime | None  # set when checkpoint retention removed the files (download: 410)
    download_url: str


class DatasetPublic(_Out):
    id: str  # what a spec names as dataset.dataset_id
    name: str
    format: str
    size: int
    sha256: str
    num_rows: int
    columns: list[str]
    prompt_column: str
    answer_column: str
    created_at: datetime


class TokenCreate(_Input):
    user: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.@-]+$")  # created if new
    admin: bool = False  # an admin token (a new user is created as an admin); an existing non-admin needs `promote`
    promote: bool = False  # with admin: make an existing non-admin user an admin (else 409)
    name: str = Field("", max_length=100)  # a label for the token


class TokenPublic(_Out):
    id: int
    user: str = Field(validation_alias="user_name")
    name: str
    prefix: str = Field(validation_alias="fingerprint")  # "tlt_…" + the first 8 hex of the token's sha256: no secret
    admin: bool  # acts as an admin (its user is one and it was made an admin token)
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class TokenCreated(TokenPublic):
    token: str  # the secret; shown only here, stored hashed


class UserPublic(_Out):
    id: int
    name: str
    is_admin: bool
