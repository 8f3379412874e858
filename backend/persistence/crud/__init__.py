"""All queries and commits of the control plane (routes, the worker and the CLI call these; none commits elsewhere),
one module per concern, re-exported here so callers write `from backend.persistence import crud; crud.get_job(...)`:

- jobs.py: create (idempotent), get with ownership, `transition()` (every state change), heartbeats, recovery
- job_views.py: what the API shows of jobs (JobPublic's fields and progress, one query): get and list
- telemetry.py: metrics, histograms, events, logs, samples, history queries and the SSE cursors
- artifacts.py: artifacts and datasets
- tokens.py: users and API tokens
- workers.py: the worker registry (capacity and heartbeats) admission reads
- common.py: the errors (NotFound, Conflict) and the dialect-aware INSERT for upserts
"""

from backend.persistence.crud.artifacts import (
    create_dataset,
    delete_dataset,
    get_artifact,
    get_dataset,
    jobs_using_dataset,
    list_artifacts,
    list_datasets,
    mark_artifacts_deleted,
    register_artifact,
    user_artifact_bytes,
    user_dataset_bytes,
)
from backend.persistence.crud.common import Conflict, Forbidden, NotFound
from backend.persistence.crud.job_views import job_view, list_jobs
from backend.persistence.crud.jobs import (
    Beat,
    add_event,
    check_job_visible,
    count_jobs_by_status,
    create_job,
    decode_cursor,
    encode_cursor,
    get_job,
    heartbeat,
    job_by_idempotency_key,
    job_status,
    request_cancel,
    retry_job,
    stale_jobs,
    transition,
)
from backend.persistence.crud.telemetry import (
    STEP_TIME_METRIC,
    JobProgress,
    add_logs,
    add_samples,
    downsample,
    finite_or_none,
    job_progress,
    list_events,
    list_histograms,
    list_logs,
    list_samples,
    metric_history,
    metric_names,
    metrics_cursor,
    new_metrics,
    stream_heads,
    upsert_histogram,
    upsert_metrics,
)
from backend.persistence.crud.tokens import (
    count_live_tokens,
    create_token,
    get_or_create_user,
    list_tokens,
    revoke_token,
    token_is_live,
    user_for_token,
)
from backend.persistence.crud.workers import Capacity, beat_worker, live_workers, register_worker, unregister_worker

__all__ = [
    "STEP_TIME_METRIC", "Beat", "Capacity", "Conflict", "Forbidden", "JobProgress", "NotFound", "add_event", "add_logs", "add_samples",
    "check_job_visible", "count_jobs_by_status", "count_live_tokens", "create_dataset", "create_job", "delete_dataset", "jobs_using_dataset", "user_dataset_bytes", "create_token", "decode_cursor",
    "downsample", "encode_cursor", "finite_or_none", "get_artifact", "get_dataset", "get_job", "get_or_create_user",
    "heartbeat", "job_by_idempotency_key", "job_progress", "job_status", "job_view", "list_artifacts", "list_datasets", "list_events",
    "list_histograms", "list_jobs", "list_logs", "list_samples", "list_tokens", "mark_artifacts_deleted",
    "metric_history", "metric_names", "metrics_cursor", "new_metrics", "register_artifact", "request_cancel",
    "retry_job", "revoke_token", "stale_jobs", "stream_heads", "token_is_live", "transition", "upsert_histogram", "upsert_metrics",
    "user_for_token", "user_artifact_bytes", "beat_worker", "live_workers", "register_worker", "unregister_worker",
]
