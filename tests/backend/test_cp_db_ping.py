"""backend.persistence.db's checkout check on Postgres (instead of pool_pre_ping): a pooled connection the server ended
while it sat idle (a restart, pg_terminate_backend) is replaced at checkout, with no error for the caller; a healthy
connection reused at once is not pinged (no extra round trips per request).

Run: python -m pytest tests/backend/test_cp_db_ping.py -q
"""

from __future__ import annotations

import time

import psycopg
from sqlalchemy import text

from backend.persistence import db
from tests.backend.conftest import PG_ADMIN


def test_a_connection_ended_by_the_server_is_replaced_at_checkout(cp_pg_url: str) -> None:
    engine = db.make_engine(cp_pg_url, pool_size=1, max_overflow=0)
    with engine.connect() as c:
        pid = c.execute(text("select pg_backend_pid()")).scalar_one()
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:  # what a Postgres restart does to every backend
        assert admin.execute("select pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
    time.sleep(0.2)  # the termination notice reaches the client socket
    with engine.connect() as c:  # within PING_IF_IDLE_S: only the readable socket says it is dead
        assert c.execute(text("select pg_backend_pid()")).scalar_one() != pid
    engine.dispose()


def test_a_busy_healthy_connection_is_not_pinged(cp_pg_url: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    engine = db.make_engine(cp_pg_url, pool_size=1, max_overflow=0)
    pings: list[object] = []
    real = db.send_ping

    def counted(conn: object) -> None:
        pings.append(conn)
        real(conn)

    monkeypatch.setattr(db, "send_ping", counted)
    for _ in range(5):  # the first checkout opens the connection, the next four reuse it at once
        with engine.connect() as c:
            assert c.execute(text("select 2")).scalar_one() == 2
    assert pings == []
    monkeypatch.setattr(db, "PING_IF_IDLE_S", 0.0)  # every connection now counts as idle too long: pinged
    with engine.connect() as c:
        assert c.execute(text("select 3")).scalar_one() == 3
    assert len(pings) == 1
    engine.dispose()
