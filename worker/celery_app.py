"""The worker's Celery application: `create_celery(settings)` builds it from backend Settings with the configuration
the API's producer shares (backend/core/broker.py). Nothing is built at import:
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

from backend.core import broker
from backend.core.config import Settings, get_settings


def create_celery(settings: Settings) -> Celery:
    """The worker's app: the shared configuration (backend/core/broker.py) with the job task's module."""
    return broker.create_celery(settings, include=["worker.tasks"])


@lru_cache(maxsize=1)
def worker_app() -> Celery:
    """The app of a worker process (settings from the environment), built on first use."""
    return create_celery(get_settings())


def __getattr__(name: str) -> Celery:
    if name == "app":  # what `celery -A worker.celery_app` looks up
        return worker_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
