"""The local `tlt` commands from any working directory, run as a user runs them (a subprocess whose cwd is a temporary
folder): the embedded home resolves to the same place wherever the command starts, `tlt token create` writes a token
the database then knows, and a database it cannot use is one line on stderr with exit status 4, never a traceback.

Run: python -m pytest tests/backend/test_cp_cli_anywhere.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from backend.core import migrate
from backend.core.config import REPO_ROOT
from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory
from worker.cli.output import EXIT_API


def _tlt(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")}
    base["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], cwd=cwd, env={**base, **env},
                          capture_output=True, text=True, timeout=120)


def _python(code: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")} | {"PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()


def test_default_home_is_the_same_from_any_folder(tmp_path: Path) -> None:
    code = "from backend.core.config import Settings; s = Settings(); print(s.home); print(s.database_url)"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    from_repo, from_elsewhere = _python(code, REPO_ROOT), _python(code, elsewhere)
    assert from_repo == from_elsewhere
    assert from_repo.splitlines()[0] == str(REPO_ROOT / ".tlt")


def test_token_create_from_another_folder(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{home / 'tlt.db'}"
    migrate.upgrade(url)
    cwd = tmp_path / "somewhere" / "else"
    cwd.mkdir(parents=True)
    run = _tlt(["token", "create", "--admin"], cwd, TLT_HOME=str(home))
    assert run.returncode == 0, run.stderr
    secret = run.stdout.strip()
    engine = make_engine(url)
    try:
        with make_session_factory(engine)() as s:
            user = crud.user_for_token(s, secret)
            assert user is not None and user.name == "admin" and user.is_admin
    finally:
        engine.dispose()
    assert not (cwd / ".tlt").exists()  # nothing written where the command happened to start


def test_unusable_database_is_one_line_and_exit_4(tmp_path: Path) -> None:
    run = _tlt(["token", "create", "--admin"], tmp_path, TLT_HOME=str(tmp_path / "no" / "such" / "home"))
    assert run.returncode == EXIT_API
    assert "Traceback" not in run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tlt: cannot use the database sqlite:///"), run.stderr
    assert "tlt db upgrade" in lines[0]
