"""backend.persistence.db.retry_transient: retries a write over a database outage (connection refused / cut), never over
other errors; gives up after its time budget. A real refused connection (a closed port) is the transient error.

Run: python -m pytest tests/backend/test_cp_db_retry.py -q
"""

from __future__ import annotations

import socket
import time

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, OperationalError

from backend.persistence.db import make_engine, retry_transient


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket is closed


def test_transient_errors_are_retried_until_the_database_answers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    down = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/x")
    up = make_engine(f"sqlite:///{tmp_path / 'ok.db'}")
    calls: list[str] = []

    def write() -> int:
        engine = down if len(calls) < 2 else up  # refused twice, then the database is back
        calls.append(engine.url.get_backend_name())
        with engine.connect() as conn:
            return int(conn.execute(text("select 7")).scalar_one())

    assert retry_transient(write, for_s=10, what="test write") == 7
    assert calls == ["postgresql", "postgresql", "sqlite"]


def test_gives_up_after_its_budget() -> None:
    down = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/x")

    def write() -> None:
        with down.connect():
            pass

    t0 = time.monotonic()
    with pytest.raises(OperationalError):
        retry_transient(write, for_s=0.6, what="test write")
    assert 0.2 < time.monotonic() - t0 < 3


def test_other_errors_are_not_retried() -> None:
    calls = 0

    def write() -> None:
        nonlocal calls
        calls += 1
        raise IntegrityError("insert", {}, Exception("duplicate key"))

    with pytest.raises(IntegrityError):
        retry_transient(write, for_s=10, what="test write")
    assert calls == 1
