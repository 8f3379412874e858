"""Private Postgres and Redis servers that a fault-injection test may stop and start: the same binaries as the shared
servers on 5432/6379, but each its own data directory and port, so restarting one never disturbs other tests (or
other people) using the shared ones. Each server is a child process of the test run; `stop()` is always safe to call.

    with PrivatePostgres() as pg:   # initdb, start; pg.url is a SQLAlchemy URL of an empty database
        pg.restart(down_s=2)                  # fast shutdown (connections cut), down for 2 s, start again
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import psycopg
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bin(name: str) -> str:
    """The newest installed Postgres' `name` (Debian keeps them in /usr/lib/postgresql/<v>/bin, not on PATH)."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    path = found[-1] if found else shutil.which(name)
    if not path:
        raise RuntimeError(f"no Postgres {name} binary found")
    return path


class _Server:
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def _wait_ready(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{type(self).__name__} exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{type(self).__name__} not ready after {timeout_s} s")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGINT) -> None:
        """Stop and wait (SIGKILL after 30 s). Postgres: SIGINT = fast shutdown; Redis: SIGINT = SHUTDOWN."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self, down_s: float = 0.0, sig: int = signal.SIGINT) -> None:
        self.stop(sig)
        time.sleep(down_s)
        self.start()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()


class PrivateRedis(_Server):
    """redis-server on a free port with an append-only file (as production runs it), so a restart keeps the queue."""

    def __init__(self, home: Path) -> None:
        self.home, self.port = home, free_port()
        home.mkdir(parents=True, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.home),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--logfile", str(self.home / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def ready(self) -> bool:
        try:
            with redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1) as r:
                return bool(r.ping())
        except redis.RedisError:
            return False


class PrivatePostgres(_Server):
    """A throwaway cluster (initdb, trust auth, fsync off) on a free port, its socket in its own directory. Run as
    the `postgres` user when the tests run as root (Postgres refuses root)."""

    def __init__(self) -> None:
        # Its own directory under the system temp dir: pytest's tmp_path (0700, root's) is closed to `postgres`.
        self.home, self.port = Path(tempfile.mkdtemp(prefix="tlt-private-pg-")), free_port()
        self.data = self.home / "data"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/tlt"
        self._user = "postgres" if os.geteuid() == 0 else None
        if self._user:
            pw = pwd.getpwnam(self._user)
            os.chown(self.home, pw.pw_uid, pw.pw_gid)
        subprocess.run([_pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync"],
                       user=self._user, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                       cwd=self.home)
        self._created = False

    def start(self) -> None:
        with open(self.home / "postgres.log", "ab") as logf:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [_pg_bin("postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.home),
                 "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200"],
                user=self._user, stdout=logf, stderr=subprocess.STDOUT, cwd=self.home,
            )
        self._wait_ready()
        if not self._created:
            with psycopg.connect(self._admin_url(), autocommit=True) as conn:
                conn.execute("CREATE DATABASE tlt")
            self._created = True

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
        shutil.rmtree(self.home, ignore_errors=True)

    def _admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def ready(self) -> bool:
        try:
            with psycopg.connect(self._admin_url(), connect_timeout=1):
                return True
        except psycopg.OperationalError:
            return False


class TcpCut:
    """A TCP proxy to `target` (host, port) that a test can cut and restore: while cut, connections are refused and
    the open ones are closed, as a network partition between one client and the server looks to that client.

        with TcpCut(("127.0.0.1", 5432)) as proxy:    # proxy.port forwards to Postgres
            proxy.cut(); ...; proxy.restore()
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.port = target, free_port()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._listener: socket.socket | None = None

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            socks, self._open = self._open, []
            listener, self._listener = self._listener, None
        for s in ([listener] if listener else []) + socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # cut: the listener was closed
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> Self:
        self.restore()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.cut()
