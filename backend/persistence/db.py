"""Engine and session factory for a Settings' database URL, and the start-up check that the schema is current.

SQLite gets WAL mode, a busy timeout and foreign keys so the API, the worker and job child processes can write to the
same file at once, and synchronous=NORMAL: in WAL mode a commit then writes the log without an fsync (the log is
synced at checkpoints), which cuts a job submission's CPU by half and its latency by 4x. A commit still survives a
crash of any process; only an OS crash or power loss can roll back the last commits, never corrupt the file
(https://sqlite.org/pragma.html#pragma_synchronous). Production runs on Postgres, whose durability is unchanged.
JSON columns are read with orjson (3x faster than json on a job spec), falling back to json where orjson would refuse
or differ (the NaN/Infinity tokens Python's json writes, integers beyond 64 bits).
Only Alembic changes the schema (`tlt db upgrade`, see backend/core/migrate.py).
`retry_transient` retries a write over a database restart (the worker's metric writes and job transitions).
"""

from __future__ import annotations

import json
import logging
import select
import time
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")
_log = logging.getLogger(__name__)


_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19  # 19 digits in a row: maybe an integer beyond 64 bits, which orjson would read as a float


def json_loads(text: str | bytes) -> Any:
    """Python's json.loads, faster: orjson gives the same values for strict JSON with no run of 19+ digits (a
    bytes.translate scan, 2 us on a job spec; re was slower than json itself); the rest (NaN/Infinity tokens, big
    integers, lone surrogates) goes to json."""
    raw = text.encode() if isinstance(text, str) else text
    if _LONG_RUN not in raw.translate(_DIGITS_TO_ZERO):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


def make_engine(url: str, **kwargs: Any) -> Engine:
    kwargs.setdefault("json_deserializer", json_loads)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False}, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA synchronous=NORMAL")  # with WAL: no fsync per commit (see the module docstring)
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    engine = create_engine(url, connect_args={"connect_timeout": 10}, **kwargs)
    _ping_when_in_doubt(engine)
    return engine


PING_IF_IDLE_S = 1.0


def _ping_when_in_doubt(engine: Engine) -> None:
    """Pessimistic disconnect handling at a fraction of `pool_pre_ping`'s cost. pre-ping sent a SELECT 1 (two round
    trips with its BEGIN) at every checkout, twice per API request. A connection checked out is now pinged only when
    in doubt: idle for over PING_IF_IDLE_S (a silent network drop), or its socket has something to read while idle
    (a restarting or stopping Postgres sends its termination notice and closes the socket: that is readable), or its
    socket is unknown. A failed ping raises DisconnectionError, on which the pool reconnects and retries the checkout,
    as with pre-ping."""

    @event.listens_for(engine, "checkin")
    def _idle_from(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.pop("idle_since", None)  # None: a new connection (nothing to check)
        if idle_since is None or (time.monotonic() - idle_since < PING_IF_IDLE_S and _quiet(dbapi_conn)):
            return
        try:
            send_ping(dbapi_conn)
        except Exception as e:  # the driver's error for a dead connection (its type varies with the failure)
            raise DisconnectionError(f"connection failed its ping: {e}") from e


def send_ping(dbapi_conn: Any) -> None:
    """SELECT 1 outside a transaction (as SQLAlchemy's psycopg pre-ping does): the connection is handed over idle, so
    its user may still set an isolation level."""
    autocommit = dbapi_conn.autocommit
    dbapi_conn.autocommit = True
    try:
        cur = dbapi_conn.cursor()
        cur.execute("SELECT 1")
        cur.close()
    finally:
        dbapi_conn.autocommit = autocommit


def _quiet(dbapi_conn: Any) -> bool:
    """True when an idle psycopg connection's socket has nothing to read (the server said nothing since)."""
    try:
        fd = dbapi_conn.pgconn.socket
    except Exception:  # closed, or not psycopg: unknown
        return False
    poller = select.poll()  # not select.select: an API holding 1,000 SSE sockets has descriptors above 1024
    poller.register(fd, select.POLLIN)
    return not poller.poll(0)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


TRANSIENT_ERRORS = (OperationalError, InterfaceError)  # connection refused or cut, server shutting down, SQLite locked


def retry_transient(fn: Callable[[], T], *, for_s: float, what: str, log: logging.Logger | None = None) -> T:
    """`fn()`, called again (backoff 0.25 s doubling to 2 s) while it fails with a transient database error (a
    Postgres restart or failover, a locked SQLite file), for up to `for_s` seconds; then the last error is raised.
    Any other error is raised at once: retrying a constraint violation or a bug would only hide it."""
    deadline = time.monotonic() + for_s
    delay = 0.25
    while True:
        try:
            return fn()
        except TRANSIENT_ERRORS as e:
            if time.monotonic() + delay > deadline:
                raise
            (log or _log).warning("%s failed (%s); retrying in %.2f s", what, type(e.orig or e).__name__, delay)
            time.sleep(delay)
            delay = min(2 * delay, 2.0)
