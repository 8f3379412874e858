"""The dashboard in a real browser against the real backend: this test migrates a fresh SQLite database with Alembic,
seeds jobs through the worker's DbReporter (tests/ui/ui_seed.py), starts uvicorn on a free localhost port serving
the API and frontend/dist, and runs the browser tests (`node --test frontend/e2e/`, playwright-core driving
Debian's chromium headless). Screenshots of the job page land in test-artifacts/.

Run: python -m pytest tests/ui -q        (needs node, npm and /usr/bin/chromium: scripts/setup.sh --dev installs chromium)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backend.core import migrate

REPO = Path(__file__).resolve().parents[2]
FRONTEND = REPO / "frontend"
SEED_SCRIPT = Path(__file__).with_name("ui_seed.py")
SHOTS = REPO / "test-artifacts"
BIG_STEPS = 10_000  # the responsiveness check: a job with this many steps of metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed (scripts/setup.sh --dev installs chromium; node and npm come with the machine)"
    return path


def _build_frontend() -> None:
    """Build dist/ when it is missing or older than a source file (setup.sh builds it too)."""
    dist = FRONTEND / "dist" / "index.html"
    sources = [p for d in ("src",) for p in (FRONTEND / d).rglob("*")] + [FRONTEND / "index.html"]
    if dist.exists() and dist.stat().st_mtime >= max(p.stat().st_mtime for p in sources):
        return
    npm = _tool("npm")
    if not (FRONTEND / "node_modules" / "playwright-core").is_dir():
        subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=FRONTEND, check=True)
    subprocess.run([npm, "run", "-s", "build"], cwd=FRONTEND, check=True)


@pytest.fixture
def ui_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "TLT_HOME": str(home),
        "TLT_DATABASE_URL": f"sqlite:///{tmp_path / 'ui.db'}",
        "TLT_BROKER_URL": f"sqla+sqlite:///{tmp_path / 'broker.db'}",
        "TLT_ARTIFACT_DIR": str(home / "artifacts"),
        "TLT_FRONTEND_DIR": str(FRONTEND / "dist"),
        "TLT_SSE_POLL_S": "0.2",
        "TLT_WORKER_TTL_S": "86400",  # the seeded worker row stays live for the whole browser run (admission)
    }
    (home / "artifacts").mkdir(parents=True)
    migrate.upgrade(env["TLT_DATABASE_URL"])
    return env


@pytest.fixture
def api_url(ui_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    log = open(tmp_path / "uvicorn.log", "wb")  # noqa: SIM115 - closed after the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "backend.main:create_app", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        cwd=REPO, env=ui_env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "uvicorn.log").read_text()
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "uvicorn did not answer /healthz within 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_ui_dashboard_in_chromium(ui_env: dict[str, str], api_url: str, tmp_path: Path) -> None:
    node, chromium = _tool("node"), _tool("chromium")
    _build_frontend()
    seed_cmd = [sys.executable, str(SEED_SCRIPT)]
    db_args = ["--db", ui_env["TLT_DATABASE_URL"], "--artifacts", ui_env["TLT_ARTIFACT_DIR"]]
    seeded = subprocess.run([*seed_cmd, "seed", *db_args, "--big-steps", str(BIG_STEPS)], env=ui_env,
                            capture_output=True, text=True, timeout=120)
    assert seeded.returncode == 0, seeded.stderr
    seed = json.loads(seeded.stdout.strip().splitlines()[-1])

    # the page itself is served by the backend (frontend/dist at /)
    index = httpx.get(f"{api_url}/", timeout=10)
    assert index.status_code == 200 and '<main id="app">' in index.text

    env = {**ui_env, "UI_BASE_URL": api_url, "UI_SEED": json.dumps(seed), "CHROMIUM": chromium,
           "UI_LIVE_CMD": json.dumps([*seed_cmd, "live", *db_args]), "UI_SCREENSHOTS": str(SHOTS)}
    run = subprocess.run([node, "--test", "--test-reporter=spec", "e2e/"], cwd=FRONTEND, env=env,
                         capture_output=True, text=True, timeout=240)
    SHOTS.mkdir(exist_ok=True)
    (SHOTS / "ui-browser-tests.log").write_text(run.stdout + run.stderr)  # incl. the 10k-step timings
    assert run.returncode == 0, f"browser tests failed:\n{run.stdout[-8000:]}\n{run.stderr[-4000:]}"
    assert (SHOTS / "ui-job-page.png").stat().st_size > 10_000
