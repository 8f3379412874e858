"""Bounded load test of the REST API: latency (p50/p90/p99/max) and errors at fixed request rates of mixed reads and
writes (open loop: requests start on schedule whether or not earlier ones finished), then N concurrent SSE clients on
one job (time to the first event, the API's CPU per stream opened and while all are held open, then the time from a
cancel to `end` on every stream: the fan-out). Prints markdown tables:
one row per rate and per SSE client count, then the per-route breakdown at the highest rate that had zero errors.

    python bench/api_load.py                                    # starts a local API (SQLite, temp dir): 200 req/s, 20 s
    python bench/api_load.py --rate 50,100,200 --duration 20 --sse 100,500,1000 --out bench/results/api_load.md
    python bench/api_load.py --database-url postgresql+psycopg://postgres@127.0.0.1/tlt_load \
        --broker-url redis://127.0.0.1:6379/14                  # the local API on Postgres + Redis (production config)
    python bench/api_load.py --url http://127.0.0.1:8000 --token $TLT_TOKEN   # against a running API

Mix (weights): GET /jobs 30, GET /jobs/{id} 25, GET /jobs/{id}/metrics 20, GET /jobs/{id}/events 10,
POST /jobs 10 (a write: insert + enqueue), POST /jobs/{id}/cancel 5 (a write: a status transition).
The local API gets TLT_SUBMIT_RATE_PER_MIN=0 (the per-token limit would turn the writes into 429s).
The rate phase's client is `--client raw` (default): keep-alive HTTP/1.1 over asyncio with httptools (C) parsing
the responses, ~5x less CPU per request than httpx (pure-Python h11), which on a 2-core box took CPU from the API it
measured; `--client httpx` measures with httpx. The SSE phase always uses httpx. "generator CPU ms/req" is this
process's CPU per request. With a local Postgres `--database-url` the rows add the CPU of its backends serving the
API per request, its transactions per request and the connections opened in the phase (see database_usage).
Targets: p99 < 50 ms at 200 req/s, zero errors, 1,000 SSE clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import httptools
import httpx

SPEC = {"model": {"builtin": "tiny-llama"}, "dataset": {"builtin": "toy-count"}, "name": "load"}
MIX = [("list", 30), ("get", 25), ("metrics", 20), ("events", 10), ("submit", 10), ("cancel", 5)]


@dataclass
class Stats:
    latencies_ms: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # kind -> non-2xx or exceptions
    late_ms: float = 0.0  # how far behind schedule the generator fell at worst (client-side saturation)
    load_avg: float = 0.0  # the machine's 1-minute load average at the end (other work on the box skews latency)
    server_cpu_s: float | None = None  # CPU seconds the local API process used in the phase (None: remote API)
    client_cpu_s: float = 0.0  # CPU seconds this process (the load generator) used in the phase
    db_cpu_s: float | None = None  # CPU seconds of the local Postgres's backends serving the API (None: not measured)
    db_xacts: int | None = None  # transactions Postgres counted for the API's database in the phase
    db_connects: int | None = None  # connections opened to it in the phase (pool churn; their CPU is not counted)

    def add(self, kind: str, ms: float, ok: bool) -> None:
        self.latencies_ms.setdefault(kind, []).append(ms)
        if not ok:
            self.errors[kind] = self.errors.get(kind, 0) + 1


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a local process so far (Linux /proc), None when unknown. Unlike latency, CPU per
    request does not grow when other work shares the machine: it says what a dedicated core would sustain."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SERVER_PID: int | None = None  # the local API's pid, set by local_api
DB_URL = ""  # the local API's Postgres database (psycopg URL), set by local_api; "" for SQLite or a remote API


def database_usage() -> tuple[float, int, int] | None:
    """(CPU seconds of the backends connected to DB_URL's database, its transaction count, its connections opened
    so far), when it is a Postgres on this machine. The CPU is that of the backends alive at the time: the API's pool
    keeps its connections, so it counts all of its database work unless connections were opened and closed in
    between (then it undercounts; the connections column shows it). Postgres shares the cores with the API, which is
    what makes 200 req/s hard on a small box."""
    if not DB_URL:
        return None
    import psycopg
    with psycopg.connect(DB_URL, autocommit=True) as conn:
        pids = [r[0] for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")]
        conn.execute("SELECT pg_stat_force_next_flush()")
        row = conn.execute("SELECT xact_commit + xact_rollback, sessions FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
    cpu = sum(c for c in (process_cpu_s(pid) for pid in pids) if c is not None)
    return cpu, int(row[0]) if row else 0, int(row[1]) if row else 0


@contextlib.contextmanager
def local_api(home: Path, database_url: str = "", broker_url: str = "") -> Iterator[tuple[str, str]]:
    """Migrate the database (default: SQLite under `home`), make an admin token, run uvicorn; yields (url, token)."""
    from backend.core import migrate
    from backend.core.config import Settings
    from backend.persistence import crud
    from backend.persistence.db import make_engine, make_session_factory

    env = {**os.environ, "TLT_HOME": str(home), "TLT_SUBMIT_RATE_PER_MIN": "0", "TLT_FRONTEND_DIR": str(home / "none"),
           "TLT_DATABASE_URL": database_url, "TLT_BROKER_URL": broker_url}
    settings = Settings(home=home, database_url=database_url, broker_url=broker_url)
    settings.ensure_dirs()
    if database_url.startswith("postgresql"):
        global DB_URL
        DB_URL = "postgresql://" + database_url.split("://", 1)[1]
    migrate.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    with make_session_factory(engine)() as s:
        token = crud.create_token(s, "bench", admin=True, name="api_load")[1]
    engine.dispose()
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "backend.main:create_app", "--factory", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning", "--no-access-log"], env=env)
    url = f"http://127.0.0.1:{port}"
    global SERVER_PID
    SERVER_PID = proc.pid
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the local API did not start")
            time.sleep(0.2)
        yield url, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of RawClient: one request at a time, the response parsed by httptools."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionError("connection closed by the server"))

    def on_body(self, body: bytes) -> None:  # httptools callbacks
        self.body.append(body)

    def on_message_complete(self) -> None:
        waiter, self.waiter, body, self.body = self.waiter, None, b"".join(self.body), []
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), body))

    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def send(self, raw: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self.waiter


class RawClient:
    """A minimal HTTP/1.1 client for the rate phase: idle keep-alive connections are reused, a new one is opened when
    all are busy (open loop), requests are written as bytes. `request` returns (status, body)."""

    def __init__(self, url: str, token: str, timeout: float = 30.0) -> None:
        u = urlsplit(url)
        self.host, self.port, self.timeout = u.hostname or "127.0.0.1", u.port or 80, timeout
        self.head = f"Host: {u.netloc}\r\nAuthorization: Bearer {token}\r\n"
        self.idle: list[_Conn] = []

    async def request(self, method: str, path: str, params: dict[str, Any] | None = None,
                      json_body: Any = None) -> tuple[int, bytes]:
        body = b"" if json_body is None else json.dumps(json_body).encode()
        target = f"{path}?{urlencode(params)}" if params else path
        kind = "Content-Type: application/json\r\n" if body else ""
        raw = f"{method} {target} HTTP/1.1\r\n{self.head}{kind}Content-Length: {len(body)}\r\n\r\n".encode() + body
        while self.idle and self.idle[-1].closed:
            self.idle.pop()
        if self.idle:
            conn = self.idle.pop()
        else:
            _, conn = await asyncio.get_running_loop().create_connection(_Conn, self.host, self.port)
        try:
            async with asyncio.timeout(self.timeout):
                result = await conn.send(raw)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            raise
        self.idle.append(conn)
        return result

    async def aclose(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()


class HttpxClient:
    """httpx behind RawClient's interface (`--client httpx`)."""

    def __init__(self, url: str, token: str, timeout: float = 30.0) -> None:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout,
                                        limits=limits)

    async def request(self, method: str, path: str, params: dict[str, Any] | None = None,
                      json_body: Any = None) -> tuple[int, bytes]:
        r = await self.client.request(method, path, params=params, json=json_body)
        return r.status_code, r.content

    async def aclose(self) -> None:
        await self.client.aclose()


Client = RawClient | HttpxClient
CLIENT_ERRORS = (httpx.HTTPError, OSError, TimeoutError, httptools.HttpParserError)


async def _one(client: Client, kind: str, job_ids: list[int], stats: Stats, rng: random.Random) -> None:
    jid = rng.choice(job_ids)
    t0 = time.perf_counter()
    try:
        if kind == "list":
            code, _ = await client.request("GET", "/api/v1/jobs", {"limit": 20})
        elif kind == "get":
            code, _ = await client.request("GET", f"/api/v1/jobs/{jid}")
        elif kind == "metrics":
            code, _ = await client.request("GET", f"/api/v1/jobs/{jid}/metrics", {"points": 200})
        elif kind == "events":
            code, _ = await client.request("GET", f"/api/v1/jobs/{jid}/events")
        elif kind == "submit":
            code, body = await client.request("POST", "/api/v1/jobs", json_body={"spec": SPEC})
            if code == 201:
                job_ids.append(json.loads(body)["id"])
        else:
            code, _ = await client.request("POST", f"/api/v1/jobs/{jid}/cancel")
        ok = code < 400 or (kind == "cancel" and code == 409)  # cancelling a final job: expected
    except CLIENT_ERRORS:
        ok = False
    stats.add(kind, (time.perf_counter() - t0) * 1000, ok)


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def rate_phase(url: str, token: str, rate: float, duration: float, seed: int,
                     client_kind: str = "raw") -> Stats:
    stats, rng = Stats(), random.Random(seed)
    kinds, weights = zip(*MIX, strict=True)
    client: Client = RawClient(url, token) if client_kind == "raw" else HttpxClient(url, token)
    try:
        job_ids = []
        for _ in range(5):  # a few jobs to read
            code, body = await client.request("POST", "/api/v1/jobs", json_body={"spec": SPEC})
            if code != 201:
                raise RuntimeError(f"could not submit a job: HTTP {code} {body[:200]!r}")
            job_ids.append(json.loads(body)["id"])
        tasks: list[asyncio.Task[None]] = []
        cpu0, own0, db0 = process_cpu_s(SERVER_PID), _own_cpu_s(), database_usage()
        start, n = time.perf_counter(), int(rate * duration)
        for i in range(n):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                stats.late_ms = max(stats.late_ms, -delay * 1000)
            kind = rng.choices(kinds, weights)[0]
            tasks.append(asyncio.create_task(_one(client, kind, job_ids, stats, rng)))
        await asyncio.gather(*tasks)
    finally:
        await client.aclose()
    stats.load_avg = os.getloadavg()[0]
    cpu1 = process_cpu_s(SERVER_PID)
    stats.server_cpu_s = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    stats.client_cpu_s = _own_cpu_s() - own0
    db1 = database_usage()
    if db0 is not None and db1 is not None:
        stats.db_cpu_s, stats.db_xacts = db1[0] - db0[0], db1[1] - db0[1] - 1  # less our own first read's
        stats.db_connects = db1[2] - db0[2] - 1
    return stats


@dataclass
class SsePhase:
    """N clients on one queued job: each connects and waits for its first event; once all have (or failed), they
    hold their streams `hold_s` together (the API's CPU over that window is the cost of N idle streams); then the
    job is cancelled and every stream must deliver the `cancelled` event and `end` (fan-out latency)."""

    clients: int
    first_ms: list[float] = field(default_factory=list)  # connect -> first event
    end_ms: list[float] = field(default_factory=list)  # cancel -> `end` on that stream
    errors: list[str] = field(default_factory=list)
    hold_cpu_pct: float | None = None  # API CPU while all streams were open and idle, % of one core
    connect_cpu_ms: float | None = None  # API CPU per stream opened (auth, catch-up read, joining the poller)


async def _sse_client(client: httpx.AsyncClient, job_id: int, ph: SsePhase, connected: asyncio.Event,
                      cancelled: asyncio.Event, cancel_at: list[float]) -> None:
    t0 = time.perf_counter()
    got_first = False
    try:
        async with client.stream("GET", f"/api/v1/jobs/{job_id}/stream") as r:
            if r.status_code != 200:
                ph.errors.append(f"HTTP {r.status_code}")
                return
            event = None
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                    if not got_first:
                        got_first = True
                        ph.first_ms.append((time.perf_counter() - t0) * 1000)
                        connected.set()
                    if event == "end":
                        if not cancelled.is_set():
                            ph.errors.append("ended before the cancel")
                        else:
                            ph.end_ms.append((time.perf_counter() - cancel_at[0]) * 1000)
                        return
            ph.errors.append("stream closed before `end`")
    except httpx.HTTPError as e:
        ph.errors.append(type(e).__name__)
    finally:
        if not got_first:
            connected.set()


async def sse_phase(url: str, token: str, clients: int, hold_s: float) -> SsePhase:
    ph = SsePhase(clients)
    # one client object, one TCP connection per stream (a client object per stream costs the generator ~20 ms each)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120,
                                 limits=limits) as c:
        job_id = (await c.post("/api/v1/jobs", json={"spec": SPEC})).json()["id"]  # queued: its stream stays open
        flags = [asyncio.Event() for _ in range(clients)]
        cancelled, cancel_at = asyncio.Event(), [0.0]
        cpu0 = process_cpu_s(SERVER_PID)
        tasks = [asyncio.create_task(_sse_client(c, job_id, ph, f, cancelled, cancel_at)) for f in flags]
        for f in flags:
            await f.wait()
        cpu1 = process_cpu_s(SERVER_PID)
        await asyncio.sleep(hold_s)
        cpu2 = process_cpu_s(SERVER_PID)
        if cpu0 is not None and cpu1 is not None and cpu2 is not None:
            ph.connect_cpu_ms = 1000 * (cpu1 - cpu0) / clients
            ph.hold_cpu_pct = 100 * (cpu2 - cpu1) / hold_s
        cancel_at[0] = time.perf_counter()
        cancelled.set()
        r = await c.post(f"/api/v1/jobs/{job_id}/cancel")
        if r.status_code >= 400:
            ph.errors.append(f"cancel: HTTP {r.status_code}")
        await asyncio.gather(*tasks)
    return ph


def rate_rows(results: list[tuple[float, Stats]]) -> list[str]:
    rows = ["| rate req/s | n | p50 ms | p90 ms | p99 ms | max ms | errors | generator late ms | load avg "
            "| API CPU ms/req | generator CPU ms/req | Postgres CPU ms/req | Postgres xacts/req | Postgres connects |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate, stats in results:
        vs = [v for kind in stats.latencies_ms.values() for v in kind]
        rows.append(f"| {rate:g} | {len(vs)} | {pct(vs, 50):.1f} | {pct(vs, 90):.1f} | {pct(vs, 99):.1f} | "
                    f"{max(vs, default=float('nan')):.1f} | {sum(stats.errors.values())} | {stats.late_ms:.0f} | "
                    f"{stats.load_avg:.1f} | {_per_req_ms(stats, len(vs))} | "
                    f"{1000 * stats.client_cpu_s / max(1, len(vs)):.2f} | {_db_per_req(stats, len(vs))} |")
    return rows


def _per_req_ms(stats: Stats, n: int) -> str:
    return "-" if stats.server_cpu_s is None or not n else f"{1000 * stats.server_cpu_s / n:.2f}"


def _db_per_req(stats: Stats, n: int) -> str:
    if stats.db_cpu_s is None or stats.db_xacts is None or not n:
        return "- | - | -"
    return f"{1000 * stats.db_cpu_s / n:.2f} | {stats.db_xacts / n:.2f} | {stats.db_connects}"


def kind_rows(stats: Stats) -> list[str]:
    rows = ["| route | n | p50 ms | p90 ms | p99 ms | max ms | errors |", "|---|---|---|---|---|---|---|"]
    for kind, _w in MIX:
        vs = stats.latencies_ms.get(kind, [])
        rows.append(f"| {kind} | {len(vs)} | {pct(vs, 50):.1f} | {pct(vs, 90):.1f} | {pct(vs, 99):.1f} | "
                    f"{max(vs, default=float('nan')):.1f} | {stats.errors.get(kind, 0)} |")
    return rows


def sse_rows(results: list[SsePhase], hold_s: float) -> list[str]:
    rows = ["| SSE clients | connected | first event p50 ms | p99 ms | max ms | API CPU ms/connect "
            f"| API CPU % holding {hold_s:g} s | cancel -> end p50 ms | p99 ms | max ms | errors |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for ph in results:
        kinds = ", ".join(f"{k}: {ph.errors.count(k)}" for k in sorted(set(ph.errors)))
        cpu = "-" if ph.connect_cpu_ms is None else f"{ph.connect_cpu_ms:.1f}"
        hold = "-" if ph.hold_cpu_pct is None else f"{ph.hold_cpu_pct:.1f}"
        rows.append(f"| {ph.clients} | {len(ph.first_ms)} | {pct(ph.first_ms, 50):.0f} | {pct(ph.first_ms, 99):.0f} | "
                    f"{max(ph.first_ms, default=float('nan')):.0f} | {cpu} | {hold} | {pct(ph.end_ms, 50):.0f} | "
                    f"{pct(ph.end_ms, 99):.0f} | {max(ph.end_ms, default=float('nan')):.0f} | "
                    f"{len(ph.errors)}{f' ({kinds})' if kinds else ''} |")
    return rows


def report(rates: list[tuple[float, Stats]], sse: list[SsePhase], duration: float, hold_s: float) -> str:
    ok = [(r, st) for r, st in rates if not st.errors]
    parts = [f"Mixed reads and writes, open loop, {duration:g} s per rate:", "", *rate_rows(rates), ""]
    if ok:
        rate, stats = max(ok, key=lambda x: x[0])
        parts += [f"Per route at {rate:g} req/s (the highest rate with zero errors):", "", *kind_rows(stats), ""]
    if sse:
        parts += ["Concurrent SSE clients on one job (connect all, hold together, cancel the job: every stream must "
                  "deliver `end`):", "", *sse_rows(sse, hold_s), ""]
    return "\n".join(parts)


def _numbers(text: str, kind: type) -> list:  # type: ignore[type-arg]
    return [kind(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running API (default: start a local one in a temp dir)")
    ap.add_argument("--token", default=os.environ.get("TLT_TOKEN"), help="with --url: a token (admin or user)")
    ap.add_argument("--database-url", default="", help="the local API's database (default: SQLite in the temp dir)")
    ap.add_argument("--broker-url", default="", help="the local API's broker (default: SQLite in the temp dir)")
    ap.add_argument("--rate", default="200", help="requests per second; a comma list runs each in turn")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per rate")
    ap.add_argument("--sse", default="100", help="concurrent SSE clients; a comma list runs each in turn (0: skip)")
    ap.add_argument("--sse-hold", type=float, default=5.0,
                    help="seconds all SSE clients hold their streams together before the job is cancelled")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client", choices=["raw", "httpx"], default="raw",
                    help="the rate phase's HTTP client (raw: keep-alive HTTP/1.1 + httptools, far less CPU)")
    ap.add_argument("--out", type=Path, help="also write the tables here")
    args = ap.parse_args()
    rates, sse_counts = _numbers(args.rate, float), [n for n in _numbers(args.sse, int) if n > 0]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # many SSE sockets (the local server inherits it)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def run(url: str, token: str) -> str:
        rate_results: list[tuple[float, Stats]] = []
        for rate in rates:  # rising; a rate with errors ends the sweep (higher ones only fail harder)
            rate_results.append((rate, await rate_phase(url, token, rate, args.duration, args.seed, args.client)))
            print("\n".join(rate_rows(rate_results)[-1:]), flush=True)
            await asyncio.sleep(args.duration / 2)  # let the server drain before the next phase
            if rate_results[-1][1].errors:
                break
        sse_results = []
        for n in sse_counts:
            sse_results.append(await sse_phase(url, token, n, args.sse_hold))
            print("\n".join(sse_rows(sse_results, args.sse_hold)[-1:]), flush=True)
        return report(rate_results, sse_results, args.duration, args.sse_hold)

    if args.url:
        if not args.token:
            ap.error("--url needs --token (or TLT_TOKEN)")
        text = asyncio.run(run(args.url, args.token))
    else:
        with (tempfile.TemporaryDirectory(prefix="tlt-load-") as d,
              local_api(Path(d), args.database_url, args.broker_url) as (url, token)):
            text = asyncio.run(run(url, token))
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
