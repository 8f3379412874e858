"""`tlt up --demo --exit` as a user runs it (and the SQLite + SQLite-broker path of the lifecycle): a fresh TLT_HOME, migrations, uvicorn + a Celery worker on SQLite and the
SQLite broker, an admin token, a demo job (the tiny spec here instead of the SmolLM2 preset, to stay fast), its final
state and artifacts printed, then everything stopped with exit status 0; every transition is in job_events.

Run: python -m pytest tests/integration/test_cp_tlt_up.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sqlalchemy import create_engine, text

from .conftest import TINY_SPEC, _free_port

pytestmark = pytest.mark.slow


def test_tlt_up_demo_runs_a_job_and_stops(tmp_path: Path) -> None:
    spec = tmp_path / "demo.yaml"
    spec.write_text(yaml.safe_dump({**TINY_SPEC, "name": "up-demo", "max_steps": 1}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")}
    env.update(TLT_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "worker.cli", "up", "--demo", "--exit", "--demo-spec", str(spec),
         "--port", str(_free_port())],
        env=env, capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "TLT Studio is up" in out and "token:      tlt_" in out
    assert f"artifacts:  {tmp_path / 'home' / 'artifacts' / 'jobs' / '1'}" in out
    assert "demo job 1 succeeded in " in out and "policy" in out and "tensorboard" in out
    assert "job 1 [" in out and "]: step 1/1 reward " in out  # the job's step lines, with the seconds since submit
    assert "  reward (mean of the step's responses)" in out  # the closing summary reads the job's metrics
    assert (tmp_path / "home" / "tlt.db").exists() and (tmp_path / "home" / "broker.db").exists()
    assert any((tmp_path / "home" / "artifacts" / "jobs" / "1").rglob("config.json"))
    engine = create_engine(f"sqlite:///{tmp_path / 'home' / 'tlt.db'}")
    with engine.connect() as c:
        events = c.execute(text("SELECT from_status, to_status, attempt, worker FROM job_events "
                                "WHERE job_id = 1 AND to_status IS NOT NULL ORDER BY id")).all()
    engine.dispose()
    assert [(f, t) for f, t, _, _ in events] == [
        (None, "queued"), ("queued", "starting"), ("starting", "running"), ("running", "succeeded")]
    assert all(a == 1 and w.startswith("tlt@") for _, t, a, w in events if t != "queued")
