"""The control plane's one settings object, read from the environment (prefix `TLT_`) by pydantic-settings.

Embedded default: everything lives under `TLT_HOME` (default: `.tlt` in the checkout, `~/.tlt` for an installed
package; never the working directory, so `tlt token create` finds the same database from any folder): a SQLite database, a SQLite-backed Celery
broker (kombu's SQLAlchemy transport) and the artifact directory. Production sets two URLs:
`TLT_DATABASE_URL=postgresql+psycopg://...` and `TLT_BROKER_URL=redis://...`.
`get_settings()` is cached; tests build their own `Settings(...)` and pass it to `create_app(settings)`.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parents[2]


def default_home() -> Path:
    """The checkout's `.tlt` (where `tlt up` and the quick start keep it), else `~/.tlt`."""
    return REPO_ROOT / ".tlt" if (REPO_ROOT / "pyproject.toml").is_file() else Path.home() / ".tlt"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TLT_", extra="ignore")

    home: Path = Field(default_factory=default_home)  # where the embedded defaults live (database, broker, artifacts)
    database_url: str = ""  # "" = sqlite:///<home>/tlt.db
    broker_url: str = ""  # "" = sqla+sqlite:///<home>/broker.db
    artifact_dir: Path | None = None  # None = <home>/artifacts; job run directories and uploaded datasets
    frontend_dir: Path = REPO_ROOT / "frontend" / "dist"  # served at / when it exists
    max_upload_mb: float = Field(default=512.0, gt=0)  # dataset upload size limit
    max_dataset_rows: int = Field(default=2_000_000, ge=0)  # rows an uploaded dataset may have (else 413); 0 = no cap
    max_dataset_row_kb: float = Field(default=1024.0, ge=0)  # bytes of one JSONL row (else 413); 0 = no cap
    max_dataset_decoded_mb: float = Field(default=512.0, ge=0)  # a parquet upload's decoded bytes (else 413); 0 = off
    check_schema: bool = True  # refuse to start when the database is not at the Alembic head
    heartbeat_s: float = Field(default=5.0, gt=0)  # worker heartbeat period
    heartbeat_timeout_s: float = Field(default=30.0, gt=0)  # a running job whose heartbeat is older is presumed lost
    cancel_grace_s: float = Field(default=30.0, ge=0)  # after a cancel, the child is hard-killed after this long
    broker_visibility_timeout_s: int = Field(default=3600, ge=1)  # Redis: an unacked job is redelivered after this long
    sse_poll_s: float = Field(default=0.5, gt=0)  # how often the SSE stream polls for new rows (< 1 s latency)
    log_tail_lines: int = Field(default=30, ge=1)  # child output lines the worker keeps to find the error line
    broker_timeout_s: float = Field(default=10.0, gt=0)  # connect/publish timeout towards the broker
    page_size_max: int = Field(default=500, ge=1)  # largest page a list endpoint returns
    sse_keepalive_s: float = Field(default=15.0, gt=0)  # SSE: a comment line is sent after this long without news
    sse_queue_max: int = Field(default=10_000, ge=1)  # SSE: rows waiting for one client before it is dropped
    sse_max_s: float = Field(default=3600.0, ge=0)  # SSE: end a stream after this long (client resumes); 0 = never
    sse_auth_check_s: float = Field(default=5.0, gt=0)  # SSE: a stream re-checks its token this often (revocation)
    max_body_kb: float = Field(default=1024.0, gt=0)  # largest JSON request body (uploads: max_upload_mb); else 413
    submit_rate_per_min: float = Field(default=60.0, ge=0)  # job submissions (and retries) per user per minute; 0 = off
    submit_burst: int = Field(default=10, ge=1)  # submissions a user may make at once before the rate applies
    max_queued_jobs_per_user: int = Field(default=100, ge=0)  # a user's jobs waiting in `queued`; more: 429; 0 = off
    max_tokens_per_user: int = Field(default=20, ge=0)  # live (unrevoked) API tokens per user; more: 409; 0 = off
    public_url: str = "http://127.0.0.1:8000"  # the dashboard URL `tlt up --demo` prints
    # Trust model (README "Trust model"): directories whose files a job spec may name by path (hf_dir, gguf, dataset
    # path, drafter warm start), os.pathsep-separated; "" = none (built-ins, uploads and artifact ids only). The
    # home and artifact directories are never readable through a spec path, whatever is listed.
    spec_roots: str = ""
    worker_ttl_s: float = Field(default=120.0, gt=0)  # a worker is live (admission) while its beat is this recent
    keep_last_checkpoints: int = Field(default=2, ge=1, le=1000)  # checkpoints kept per job (caps save_total_limit)
    user_quota_gb: float = Field(default=200.0, ge=0)  # artifact bytes a user may hold before submits are 409; 0 = off

    @field_validator("home", mode="after")
    @classmethod
    def _absolute_home(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.home / 'tlt.db'}"
        if not self.broker_url:
            self.broker_url = f"sqla+sqlite:///{self.home / 'broker.db'}"
        if self.artifact_dir is None:
            self.artifact_dir = self.home / "artifacts"
        self.artifact_dir = self.artifact_dir.expanduser().resolve()
        if self.database_url.startswith("postgresql://"):
            # psycopg 3 is the driver we ship; plain postgresql:// would ask for psycopg2.
            self.database_url = "postgresql+psycopg://" + self.database_url.removeprefix("postgresql://")
        return self

    @property
    def artifacts(self) -> Path:
        assert self.artifact_dir is not None  # filled by the validator
        return self.artifact_dir

    @property
    def spec_root_paths(self) -> tuple[Path, ...]:
        """TLT_SPEC_ROOTS resolved (realpath); empty entries ignored."""
        return tuple(Path(os.path.realpath(p)) for p in self.spec_roots.split(os.pathsep) if p.strip())

    @property
    def private_dirs(self) -> tuple[Path, ...]:
        """Never readable through a spec path: the database, broker, uploads and every job's artifacts."""
        return Path(os.path.realpath(self.home)), Path(os.path.realpath(self.artifacts))

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_kb * 1024)

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    def ensure_dirs(self) -> None:
        """Create the embedded-default directories (called at start-up, never at import)."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.artifacts.mkdir(parents=True, exist_ok=True)


@lru_cache
def get_settings() -> Settings:
    return Settings()
