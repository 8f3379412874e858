"""Fault injection with real services: while a short job runs on a real API + Celery worker, restart Redis,
restart Postgres, SIGKILL the worker, or SIGKILL and restart the API under an SSE client. Each test asserts the exact
list of the job's metric points (step x name) against an uninterrupted run of the same spec: nothing lost, nothing
twice. Postgres and Redis are private servers of this module (tests/integration/services.py), so restarting them
disturbs nobody; a fixture brings every part back up after each test, pass or fail.

Run: python -m pytest tests/integration/test_hard_faults.py -q   (about a minute on 2 cores)
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from worker.client import SseEvent, TltClient

from .conftest import TINY_SPEC, Stack, _start_stack, _stop_stack
from .services import PrivatePostgres, PrivateRedis

pytestmark = pytest.mark.slow
# Steps take ~0.3 s here and the child ~10 s to start: 12 steps leave seconds of run for a fault to land in.
SPEC = {**TINY_SPEC, "name": "fault", "max_steps": 12, "save_steps": 1}
# Values that depend on the wall clock, not on the training: they differ between any two runs.
CLOCK_METRICS = ("timing_s/", "perf/", "harvest/")
Point = tuple[int, str]


class Faults:
    def __init__(self, stack: Stack, pg: PrivatePostgres, redis: PrivateRedis) -> None:
        self.stack, self.pg, self.redis = stack, pg, redis

    def ensure_up(self) -> None:
        """Every service back up: the servers, the API, one live worker."""
        for server in (self.pg, self.redis):
            if server.proc is None or server.proc.poll() is not None:
                server.start()
        if self.stack.api is None or self.stack.api.poll() is not None:
            self.stack.start_api()
        if not any(w.poll() is None for w in self.stack.workers):
            self.stack.start_worker()


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faults]:
    home = tmp_path_factory.mktemp("faults")
    with PrivatePostgres() as pg, PrivateRedis(home / "redis") as redis:
        stack = _start_stack("faults", home, pg.url, redis.url)
        try:
            yield Faults(stack, pg, redis)
        finally:
            _stop_stack(stack)


@pytest.fixture
def fs(faults: Faults) -> Iterator[Faults]:
    faults.ensure_up()
    try:
        yield faults
    finally:
        faults.ensure_up()


def submit(stack: Stack, name: str, **overrides: object) -> int:
    with stack.http() as c:
        r = c.post("/jobs", json={"spec": {**SPEC, "name": name, **overrides}})
        assert r.status_code == 201, r.text
        return int(r.json()["id"])


def points(stack: Stack, job_id: int) -> list[tuple[Point, float | None]]:
    """Every stored metric point of the job as ((step, name), value), in (name, step) order, duplicates kept."""
    with stack.http() as c:
        hist = c.get(f"/jobs/{job_id}/metrics").json()
    return [((p["step"], s["name"]), p["value"]) for s in hist["series"] for p in s["points"]]


def wait_step(stack: Stack, job_id: int, step: int, timeout_s: float = 90) -> None:
    """Return once the job has stored `step`, asserting it is still running (a fault injected after the job ended
    would prove nothing)."""
    deadline = time.monotonic() + timeout_s
    with stack.http() as c:
        while time.monotonic() < deadline:
            last = c.get(f"/jobs/{job_id}/metrics", params={"names": "reward/mean"}).json()["last_step"]
            if last is not None and last >= step:
                assert last < SPEC["max_steps"], "the job ended before the fault: make it longer"
                return
            time.sleep(0.1)
    raise AssertionError(f"job {job_id} never reached step {step}\n{stack.worker_logs()}")


@pytest.fixture(scope="module")
def reference(faults: Faults) -> list[tuple[Point, float | None]]:
    """The metric points of an uninterrupted run of SPEC."""
    faults.ensure_up()
    job_id = submit(faults.stack, "reference")
    final = faults.stack.wait_job(job_id)
    assert final["status"] == "succeeded", final
    return points(faults.stack, job_id)


def assert_same_points(got: list[tuple[Point, float | None]], want: list[tuple[Point, float | None]]) -> None:
    keys = [k for k, _ in got]
    assert not [k for k, n in Counter(keys).items() if n > 1], "duplicated points"
    assert keys == [k for k, _ in want]  # same steps x names: none lost, none extra
    steps = {s for s, _ in keys}
    assert steps == set(range(1, SPEC["max_steps"] + 1))


def assert_ran_once(stack: Stack, job_id: int) -> dict:
    final = stack.wait_job(job_id)
    assert final["status"] == "succeeded", f"{final}\n{stack.worker_logs()}"
    assert final["attempt"] == 1, final  # the fault did not cost the attempt
    return final


def test_redis_restart_while_a_job_runs(fs: Faults, reference: list) -> None:
    job_id = submit(fs.stack, "redis-restart")
    wait_step(fs.stack, job_id, 1)
    fs.redis.restart(down_s=2)
    assert_ran_once(fs.stack, job_id)
    assert_same_points(points(fs.stack, job_id), reference)
    # The broker is usable again: a job submitted now runs.
    again = submit(fs.stack, "after-redis-restart", max_steps=1)
    assert fs.stack.wait_job(again)["status"] == "succeeded"


def test_postgres_restart_while_a_job_runs(fs: Faults, reference: list) -> None:
    job_id = submit(fs.stack, "postgres-restart")
    wait_step(fs.stack, job_id, 1)
    fs.pg.restart(down_s=3)  # fast shutdown: every open connection is cut; the worker buffers and retries
    assert_ran_once(fs.stack, job_id)
    with fs.stack.http() as c:
        output = [ln["line"] for ln in c.get(f"/jobs/{job_id}/logs", params={"limit": 5000}).json()]
    # The outage did hit the job's writes (else this test proves nothing): the child logged its retries (of a step's
    # metrics or of a checkpoint's registration, whichever the restart landed on).
    retried = [ln for ln in output if f"job {job_id}: " in ln and "failed (OperationalError); retrying" in ln]
    assert retried, "\n".join(output[-40:])
    assert_same_points(points(fs.stack, job_id), reference)


def test_worker_sigkill_resumes_from_checkpoint(fs: Faults, reference: list) -> None:
    job_id = submit(fs.stack, "worker-sigkill")
    wait_step(fs.stack, job_id, 3)
    victim = next(w for w in fs.stack.workers if w.poll() is None)
    fs.stack.kill_worker(victim)
    fs.stack.start_worker()
    final = fs.stack.wait_job(job_id)
    assert final["status"] == "succeeded", f"{final}\n{fs.stack.worker_logs()}"
    assert final["attempt"] == 2
    got = points(fs.stack, job_id)
    assert_same_points(got, reference)
    # Resumed, not restarted: exact resume makes the training metrics equal those of the uninterrupted run.
    want = dict(reference)
    diff = {k: (v, want[k]) for k, v in got if not k[1].startswith(CLOCK_METRICS) and v != want[k]}
    assert not diff, diff
    with fs.stack.http() as c:
        logs = " ".join(line["line"] for line in c.get(f"/jobs/{job_id}/logs").json())
    assert "resum" in logs.lower()


def test_api_restart_under_an_sse_client(fs: Faults, reference: list) -> None:
    job_id = submit(fs.stack, "api-restart")
    received: list[tuple[float, SseEvent]] = []
    errors: list[BaseException] = []

    def follow() -> None:
        client = TltClient(fs.stack.url, fs.stack.token)
        try:
            for ev in client.follow(job_id, reconnect_for_s=60, retry_s=0.2):
                received.append((time.monotonic(), ev))
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)
        finally:
            client.close()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    wait_step(fs.stack, job_id, 1)
    killed_at = time.monotonic()
    fs.stack.kill_api()
    time.sleep(1.0)  # the client's reconnects are refused meanwhile
    fs.stack.start_api()
    reader.join(timeout=120)
    assert not reader.is_alive() and not errors, errors
    events = [ev for _, ev in received]
    assert events[-1].event == "end" and events[-1].data["status"] == "succeeded"
    assert any(t < killed_at for t, _ in received) and any(t > killed_at for t, _ in received)
    ids = [ev.id for ev in events[:-1]]  # `end` repeats the cursor of the message before it
    twice = [i for i, n in Counter(ids).items() if n > 1]
    assert not twice, f"delivered twice: {twice}"

    # Exactly once: what the stream delivered equals what the database holds, table by table.
    stored = points(fs.stack, job_id)
    assert_same_points(stored, reference)
    metrics = sorted((ev.data["name"], ev.data["step"]) for ev in events if ev.event == "metric")
    assert metrics == sorted((name, step) for (step, name), _ in stored)
    with fs.stack.http() as c:
        stored_events = [e["id"] for e in c.get(f"/jobs/{job_id}/events").json()]
        stored_logs = [ln["id"] for ln in c.get(f"/jobs/{job_id}/logs", params={"limit": 1000}).json()]
    assert [ev.data["id"] for ev in events if ev.event == "event"] == stored_events
    assert [ev.data["id"] for ev in events if ev.event == "log"] == stored_logs

