"""The Celery app is built by a factory, nothing at import (a fresh interpreter importing worker.celery_app builds no
app and reads no settings), `celery -A worker.celery_app` still finds the app with the job task under the one name
the API sends; and the worker's capacity probe honours CUDA_VISIBLE_DEVICES.

Run: python -m pytest tests/backend/test_cp_safety_celery.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from backend.core.dispatch import RUN_JOB_TASK
from worker import registry

PROBE = """
import worker.celery_app as m
assert m.worker_app.cache_info().currsize == 0, "an app was built at import"
from celery.app.utils import find_app
app = find_app("worker.celery_app")
import worker.tasks
assert app is m.worker_app() and {task!r} in app.tasks, sorted(app.tasks)
print("ok", app.conf.broker_url)
"""


def test_no_app_at_import_and_celery_dash_a_finds_it(tmp_path) -> None:
    env = {**os.environ, "TLT_HOME": str(tmp_path), "TLT_BROKER_URL": "memory://"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(task=RUN_JOB_TASK)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok memory://"


def test_probe_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cap = registry.probe(["cpu"])
    assert (cap.queues, cap.gpus, cap.gpu_memory_gb, cap.cuda) == (["cpu"], 0, 0.0, None)
    assert cap.host_memory_gb > 0.1


def test_probe_counts_only_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi lists 4 GPUs; CUDA_VISIBLE_DEVICES=1,3 gives the worker 2, sized by the smaller."""
    table = "0, 81559\n1, 81559\n2, 40960\n3, 24576\n"

    def smi(*args: str) -> str:
        return table if args else "| NVIDIA-SMI 570.1   Driver Version: 570.1   CUDA Version: 12.8 |"

    monkeypatch.setattr(registry, "_nvidia_smi", smi)
    assert registry.gpus_visible("1,3") == (2, 24.0, "12.8")
    assert registry.gpus_visible(None) == (4, 24.0, "12.8")
    assert registry.gpus_visible("") == (0, 0.0, None)
