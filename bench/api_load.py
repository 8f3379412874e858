"""Bounded load test of the REST API: latency (p50/p90/p99/max) and errors at fixed request rates of mixed reads and
writes (open loop: requests start on schedule whether or not earlier ones finished), then N concurrent SSE clients
(time to the first event, errors, and whether every stream stayed open for the hold time). Prints markdown tables:
one row per rate and per SSE client count, then the per-route breakdown at the highest rate that had zero errors.

    python bench/api_load.py                                    # starts a local API (SQLite, temp dir): 200 req/s, 20 s
    python bench/api_load.py --rate 50,100,200 --duration 20 --sse 100,500,1000 --out bench/results/api_load.md
    python bench/api_load.py --database-url postgresql+psycopg://postgres@127.0.0.1/tlt_load \
        --broker-url redis://127.0.0.1:6379/14                  # the local API on Postgres + Redis (production config)
    python bench/api_load.py --url http://127.0.0.1:8000 --token $TLT_TOKEN   # against a running API

Mix (weights): GET /jobs 30, GET /jobs/{id} 25, GET /jobs/{id}/metrics 20, GET /jobs/{id}/events 10,
POST /jobs 10 (a write: insert + enqueue), POST /jobs/{id}/cancel 5 (a write: a status transition).
The local API gets TLT_SUBMIT_RATE_PER_MIN=0 (the per-token limit would turn the writes into 429s).
Issue 10's targets: p99 < 50 ms at 200 req/s, zero errors, 1,000 SSE clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


@contextlib.contextmanager
def local_api(home: Path, database_url: str = "", broker_url: str = "") -> Iterator[tuple[str, str]]:
    """Migrate the database (default: SQLite under `home`), make an admin token, run uvicorn; yields (url, token)."""
    from backend import crud
    from backend.core import migrate
    from backend.core.config import Settings
    from backend.core.db import make_engine, make_session_factory

    env = {**os.environ, "TLT_HOME": str(home), "TLT_SUBMIT_RATE_PER_MIN": "0", "TLT_FRONTEND_DIR": str(home / "none"),
           "TLT_DATABASE_URL": database_url, "TLT_BROKER_URL": broker_url}
    settings = Settings(home=home, database_url=database_url, broker_url=broker_url)
    settings.ensure_dirs()
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


async def _one(client: httpx.AsyncClient, kind: str, job_ids: list[int], stats: Stats, rng: random.Random) -> None:
    jid = rng.choice(job_ids)
    t0 = time.perf_counter()
    try:
        if kind == "list":
            r = await client.get("/api/v1/jobs", params={"limit": 20})
        elif kind == "get":
            r = await client.get(f"/api/v1/jobs/{jid}")
        elif kind == "metrics":
            r = await client.get(f"/api/v1/jobs/{jid}/metrics", params={"points": 200})
        elif kind == "events":
            r = await client.get(f"/api/v1/jobs/{jid}/events")
        elif kind == "submit":
            r = await client.post("/api/v1/jobs", json={"spec": SPEC})
            if r.status_code == 201:
                job_ids.append(r.json()["id"])
        else:
            r = await client.post(f"/api/v1/jobs/{jid}/cancel")
        ok = r.status_code < 400 or (kind == "cancel" and r.status_code == 409)  # cancelling a final job: expected
    except httpx.HTTPError:
        ok = False
    stats.add(kind, (time.perf_counter() - t0) * 1000, ok)


async def rate_phase(url: str, token: str, rate: float, duration: float, seed: int) -> Stats:
    stats, rng = Stats(), random.Random(seed)
    kinds, weights = zip(*MIX, strict=True)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30,
                                 limits=limits) as client:
        job_ids = []
        for _ in range(5):  # a few jobs to read
            r = await client.post("/api/v1/jobs", json={"spec": SPEC})
            r.raise_for_status()
            job_ids.append(r.json()["id"])
        tasks: list[asyncio.Task[None]] = []
        cpu0 = process_cpu_s(SERVER_PID)
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
    stats.load_avg = os.getloadavg()[0]
    cpu1 = process_cpu_s(SERVER_PID)
    stats.server_cpu_s = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    return stats


async def _sse_client(url: str, token: str, job_id: int, hold_s: float, out: list[float], errors: list[str]) -> None:
    """Open the stream, time its first event, keep reading until `hold_s` after it (the keep-alive and `retry:` lines
    keep coming); a stream the server closes earlier counts as an error."""
    t0 = time.perf_counter()
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client, client.stream(
            "GET", f"/api/v1/jobs/{job_id}/stream", headers={"Authorization": f"Bearer {token}"}
        ) as r:
            if r.status_code != 200:
                errors.append(f"HTTP {r.status_code}")
                return
            first = None
            async for line in r.aiter_lines():
                if first is None and line.startswith("event:"):
                    first = time.perf_counter()
                    out.append((first - t0) * 1000)
                if first is not None and time.perf_counter() - first > hold_s:
                    break
            if first is None:
                errors.append("stream ended before any event")
            elif time.perf_counter() - first < hold_s:
                errors.append("stream closed before the hold time")
    except httpx.HTTPError as e:
        errors.append(type(e).__name__)


async def sse_phase(url: str, token: str, clients: int, hold_s: float) -> tuple[list[float], list[str]]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as c:
        job_id = (await c.post("/api/v1/jobs", json={"spec": SPEC})).json()["id"]  # queued: its stream stays open
    firsts: list[float] = []
    errors: list[str] = []
    await asyncio.gather(*(_sse_client(url, token, job_id, hold_s, firsts, errors) for _ in range(clients)))
    return firsts, errors


def rate_rows(results: list[tuple[float, Stats]]) -> list[str]:
    rows = ["| rate req/s | n | p50 ms | p90 ms | p99 ms | max ms | errors | generator late ms | load avg "
            "| API CPU ms/req |", "|---|---|---|---|---|---|---|---|---|---|"]
    for rate, stats in results:
        vs = [v for kind in stats.latencies_ms.values() for v in kind]
        rows.append(f"| {rate:g} | {len(vs)} | {pct(vs, 50):.1f} | {pct(vs, 90):.1f} | {pct(vs, 99):.1f} | "
                    f"{max(vs, default=float('nan')):.1f} | {sum(stats.errors.values())} | {stats.late_ms:.0f} | "
                    f"{stats.load_avg:.1f} | {_per_req_ms(stats, len(vs))} |")
    return rows


def _per_req_ms(stats: Stats, n: int) -> str:
    return "-" if stats.server_cpu_s is None or not n else f"{1000 * stats.server_cpu_s / n:.1f}"


def kind_rows(stats: Stats) -> list[str]:
    rows = ["| route | n | p50 ms | p90 ms | p99 ms | max ms | errors |", "|---|---|---|---|---|---|---|"]
    for kind, _w in MIX:
        vs = stats.latencies_ms.get(kind, [])
        rows.append(f"| {kind} | {len(vs)} | {pct(vs, 50):.1f} | {pct(vs, 90):.1f} | {pct(vs, 99):.1f} | "
                    f"{max(vs, default=float('nan')):.1f} | {stats.errors.get(kind, 0)} |")
    return rows


def sse_rows(results: list[tuple[int, list[float], list[str]]], hold_s: float) -> list[str]:
    rows = [f"| SSE clients | connected | first event p50 ms | p99 ms | max ms | errors (held {hold_s:g} s) |",
            "|---|---|---|---|---|---|"]
    for n, firsts, errors in results:
        kinds = ", ".join(f"{k}: {errors.count(k)}" for k in sorted(set(errors)))
        rows.append(f"| {n} | {len(firsts)} | {pct(firsts, 50):.1f} | {pct(firsts, 99):.1f} | "
                    f"{max(firsts, default=float('nan')):.1f} | {len(errors)}{f' ({kinds})' if kinds else ''} |")
    return rows


def report(rates: list[tuple[float, Stats]], sse: list[tuple[int, list[float], list[str]]], duration: float,
           hold_s: float) -> str:
    ok = [(r, st) for r, st in rates if not st.errors]
    parts = [f"Mixed reads and writes, open loop, {duration:g} s per rate:", "", *rate_rows(rates), ""]
    if ok:
        rate, stats = max(ok, key=lambda x: x[0])
        parts += [f"Per route at {rate:g} req/s (the highest rate with zero errors):", "", *kind_rows(stats), ""]
    if sse:
        parts += ["Concurrent SSE clients on one running job:", "", *sse_rows(sse, hold_s), ""]
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
    ap.add_argument("--sse-hold", type=float, default=3.0, help="seconds each SSE client stays after its first event")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the tables here")
    args = ap.parse_args()
    rates, sse_counts = _numbers(args.rate, float), [n for n in _numbers(args.sse, int) if n > 0]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # many SSE sockets (the local server inherits it)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def run(url: str, token: str) -> str:
        rate_results: list[tuple[float, Stats]] = []
        for rate in rates:  # rising; a rate with errors ends the sweep (higher ones only fail harder)
            rate_results.append((rate, await rate_phase(url, token, rate, args.duration, args.seed)))
            print("\n".join(rate_rows(rate_results)[-1:]), flush=True)
            await asyncio.sleep(args.duration / 2)  # let the server drain before the next phase
            if rate_results[-1][1].errors:
                break
        sse_results = []
        for n in sse_counts:
            sse_results.append((n, *await sse_phase(url, token, n, args.sse_hold)))
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
