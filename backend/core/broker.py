"""The Celery configuration that the API (a producer, backend/core/dispatch.py) and the worker (a consumer,
worker/celery_app.py) share: broker URL and transport timeouts from Settings, one exchange per resource-class queue,
and the delivery guarantees of long GPU jobs. A pure module: it imports no worker code, so the API builds its
producer without importing the worker.

    app = create_celery(settings)                              # the API's producer
    app = create_celery(settings, include=["worker.tasks"])    # the worker's app, with its tasks
"""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery
from kombu import Exchange, Queue

from backend.core.config import Settings

QUEUES = ("cpu", "gpu")  # the resource classes (JobSpec.queue picks one, or resources.queue names another)


def create_celery(settings: Settings, include: Sequence[str] = ()) -> Celery:
    """A Celery app configured from `settings`; `include` names task modules to import (the worker's only)."""
    app = Celery("tlt", broker=settings.broker_url, include=list(include))
    transport_options: dict[str, object] = {}
    if settings.broker_url.startswith(("redis", "rediss")):
        transport_options = {
            "visibility_timeout": settings.broker_visibility_timeout_s,
            "socket_timeout": settings.broker_timeout_s,
            "socket_connect_timeout": settings.broker_timeout_s,
        }
    app.conf.update(
        # Each resource class its own exchange + routing key (a bare Queue("gpu") would inherit the default's).
        task_queues=[Queue(q, Exchange(q, type="direct"), routing_key=q) for q in QUEUES],
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
