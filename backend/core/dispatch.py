"""Enqueue jobs on the Celery broker (called after the job row is committed, never inside the transaction).

The API holds a producer-only Celery app built from Settings with the configuration the worker shares
(backend/core/broker.py); the task itself lives in worker/tasks.py and is addressed by name, so the API process never
imports the worker's runtime (a layering test keeps it so).
"""

from __future__ import annotations

import logging

from celery import Celery

from backend.core.broker import create_celery
from backend.core.config import Settings

log = logging.getLogger(__name__)
RUN_JOB_TASK = "tlt.run_job"  # the one name of the job task: sent here, registered by worker/tasks.py


class EnqueueError(RuntimeError):
    pass


class Dispatcher:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._app: Celery | None = None

    @property
    def app(self) -> Celery:
        if self._app is None:  # lazily: creating the app opens nothing, but keep start-up free of broker work
            self._app = create_celery(self._settings)
        return self._app

    def enqueue(self, job_id: int, queue: str) -> None:
        try:  # connection timeouts come from the app's broker settings (broker_timeout_s)
            self.app.send_task(
                RUN_JOB_TASK, args=[job_id], queue=queue,
                retry=True, retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5},
            )
        except Exception as e:  # any broker/transport failure becomes one clear error for the caller
            log.exception("enqueue of job %s failed", job_id)
            raise EnqueueError(f"could not reach the broker: {e}") from e

    def close(self) -> None:
        if self._app is not None:
            self._app.close()
