"""The Celery application: `create_celery(settings)` builds it from backend Settings. Nothing is built at import:
`celery -A worker.celery_app worker -Q cpu,gpu` reads the module's `app` attribute, which builds the worker's app
from `get_settings()` on that first access (a module `__getattr__`), once.

Queues per resource class (`cpu`, `gpu`, or JobSpec.resources.queue). Long GPU jobs: acks_late +
task_reject_on_worker_lost + prefetch 1, so a job whose worker dies is redelivered (Redis: after the visibility
timeout) and resumed from its last checkpoint by the next worker (worker/tasks.py).

Run a worker:  celery -A worker.celery_app worker -Q cpu,gpu --pool threads --concurrency 1
"""

from __future__ import annotations

from functools import lru_cache

from celery import Celery
from kombu import Exchange, Queue

from backend.core.config import Settings, get_settings


def create_celery(settings: Settings) -> Celery:
    app = Celery("tlt", broker=settings.broker_url, include=["worker.tasks"])
    transport_options: dict[str, object] = {}
    if settings.broker_url.startswith(("redis", "rediss")):
        transport_options = {
            "visibility_timeout": settings.broker_visibility_timeout_s,
            "socket_timeout": settings.broker_timeout_s,
            "socket_connect_timeout": settings.broker_timeout_s,
        }
    app.conf.update(
        # Each resource class its own exchange + routing key (a bare Queue("gpu") would inherit the default's).
        task_queues=[Queue(q, Exchange(q, type="direct"), routing_key=q) for q in ("cpu", "gpu")],
        task_default_queue="cpu",
        task_acks_late=True,  # ack only when run_job returns: a worker that dies mid-job leaves it to be redelivered
        task_reject_on_worker_lost=True,  # a pool process killed mid-task requeues the message instead of failing it
        worker_prefetch_multiplier=1,  # one job at a time per worker slot; never hoard queued jobs
        task_track_started=False,  # the job row is the state of record, not Celery's result backend
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=settings.broker_timeout_s,
        broker_transport_options=transport_options,
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        task_serializer="json",
        accept_content=["json"],
    )
    app.conf.tlt_settings = settings  # the tasks read the same Settings the app was built from
    return app


@lru_cache(maxsize=1)
def worker_app() -> Celery:
    """The app of a worker process (settings from the environment), built on first use."""
    return create_celery(get_settings())


def __getattr__(name: str) -> Celery:
    if name == "app":  # what `celery -A worker.celery_app` looks up
        return worker_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
