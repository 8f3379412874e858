"""SSE fan-out (backend/sse_fanout.py, 1,000 clients): many streams of one job cost ONE poll per interval
(counted on the engine), every stream receives every row above its own cursor exactly once and in order (streams
joining at different times, from different Last-Event-IDs, while rows are written), a client that reads too slowly
is dropped with its mailbox emptied, and the poller stops when the last stream leaves. The streams are the route's
own generator (`follow`) driven on an event loop, without HTTP; tests/backend/test_cp_sse_fanout.py covers HTTP.

Run: python -m pytest tests/hardening/test_hard_sse_fanout.py -q
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.orm import Session, sessionmaker

from backend.api.routes.stream import TokenWatch, follow
from backend.core.config import Settings
from backend.lifecycle import JobStatus
from backend.persistence import crud
from backend.persistence.db import make_engine, make_session_factory
from backend.persistence.models import JobEvent, LogLine, Metric
from backend.sse_fanout import JobStreams, Mailbox, Subscriber
from tests.specs import api_spec
from worker.tlt.config import JobSpec

SPEC = api_spec()
POLL_S = 0.05


def _setup(hard_settings: Callable[..., Settings], home: Path, **kw: Any) -> tuple[Settings, sessionmaker[Session], int]:
    settings = hard_settings(home, sse_poll_s=POLL_S, sse_max_s=0.0, **kw)
    factory = make_session_factory(make_engine(settings.database_url))
    with factory() as s:
        owner = crud.get_or_create_user(s, "alice")
        job, _ = crud.create_job(s, owner, JobSpec.model_validate(SPEC), None)
        crud.transition(s, job.id, JobStatus.starting, worker="w", new_attempt=True)
        crud.transition(s, job.id, JobStatus.running)
    return settings, factory, job.id


def _messages(text: str) -> list[tuple[str, str, dict]]:
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], fields["id"], json.loads(fields["data"])))
    return out


class Client:
    """One stream: the route's generator, consumed by a task; messages parsed as they come."""

    def __init__(self, job_id: int, cursor: list[int], factory: sessionmaker[Session], streams: JobStreams,
                 settings: Settings) -> None:
        self.start = list(cursor)
        self.sub = Subscriber(job_id, cursor, Mailbox(settings.sse_queue_max))
        with factory() as s:  # the stream's own token, re-checked as the route does
            secret = crud.create_token(s, "alice")[1]
        self.gen = follow(self.sub, factory, streams, settings, TokenWatch(factory, secret, settings.sse_auth_check_s))
        self.messages: list[tuple[str, str, dict]] = []
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        async for text in self.gen:
            self.messages += _messages(text)

    async def close(self) -> None:  # what SseResponse does when the client goes away
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.gen.aclose()


def _count_polls(factory: sessionmaker[Session]) -> list[int]:
    """A one-item list counting the statements that read job_events (one per stream read or poll)."""
    counter = [0]

    @event.listens_for(factory.kw["bind"], "before_cursor_execute")
    def _count(_conn: Any, _cur: Any, statement: str, *_: Any) -> None:
        if "FROM job_events" in statement:
            counter[0] += 1

    return counter


async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _stored(factory: sessionmaker[Session], job_id: int) -> dict[str, list[int]]:
    with factory() as s:
        return {kind: list(s.scalars(select(model.id).where(model.job_id == job_id).order_by(model.id)))
                for kind, model in (("metric", Metric), ("event", JobEvent), ("log", LogLine))}


def test_many_streams_cost_one_poll_per_interval(hard_settings: Callable[..., Settings], tmp_path: Path) -> None:
    settings, factory, job_id = _setup(hard_settings, tmp_path)
    polls = _count_polls(factory)

    async def main() -> None:
        streams = JobStreams(settings.sse_poll_s)
        clients = [Client(job_id, [0, 0, 0], factory, streams, settings) for _ in range(50)]
        await _until(lambda: job_id in streams.pollers and len(streams.pollers[job_id].subscribers) == 50)
        assert len(streams.pollers) == 1
        n0, t0 = polls[0], time.monotonic()
        await asyncio.sleep(1.0)
        n, elapsed = polls[0] - n0, time.monotonic() - t0
        # one read per interval for all 50 streams (a stream polling itself would make 50x as many)
        assert 0.5 * elapsed / POLL_S <= n <= elapsed / POLL_S + 2, (n, elapsed)
        with factory() as s:
            crud.upsert_metrics(s, job_id, [(1, "reward/mean", 0.5)])
            s.commit()
            crud.transition(s, job_id, JobStatus.succeeded)
        await asyncio.wait_for(asyncio.gather(*(c.task for c in clients)), 10)
        stored = _stored(factory, job_id)
        for c in clients:
            kinds = [m[0] for m in c.messages]  # within one read, events come before metrics and logs
            assert sorted(kinds[:-1]) == ["event"] * 4 + ["metric"] and kinds[-1] == "end"
            assert [m[2]["id"] for m in c.messages if m[0] == "event"] == stored["event"]
        await _until(lambda: not streams.pollers)

    asyncio.run(main())


def test_every_stream_gets_every_row_once_in_order(hard_settings: Callable[..., Settings], tmp_path: Path) -> None:
    """Streams join at different times with different cursors while a writer adds metrics, events and logs."""
    settings, factory, job_id = _setup(hard_settings, tmp_path)

    def writer() -> None:
        with factory() as s:
            for step in range(1, 41):
                crud.upsert_metrics(s, job_id, [(step, "reward/mean", step / 10), (step, "actor/kl", 0.1)])
                crud.add_logs(s, job_id, 1, [f"step {step}"])
                s.commit()
                if step % 10 == 0:
                    crud.add_event(s, job_id, f"checkpoint {step}")
                time.sleep(0.01)
            crud.transition(s, job_id, JobStatus.succeeded)

    async def main() -> None:
        streams = JobStreams(settings.sse_poll_s)
        clients: list[Client] = []
        thread = threading.Thread(target=writer)
        thread.start()
        for i in range(12):
            with factory() as s:
                heads = crud.stream_heads(s, job_id)
            cursor = [[0, 0, 0], list(heads), [heads[0] // 2, 0, heads[2]]][i % 3]
            clients.append(Client(job_id, cursor, factory, streams, settings))
            await asyncio.sleep(0.03)
        await asyncio.to_thread(thread.join)
        await asyncio.wait_for(asyncio.gather(*(c.task for c in clients)), 10)
        stored = _stored(factory, job_id)
        assert len(stored["metric"]) == 80 and len(stored["log"]) == 40
        table = {"metric": 0, "event": 1, "log": 2}
        for c in clients:
            assert c.messages[-1][0] == "end" and c.messages[-1][2]["status"] == "succeeded"
            got: dict[str, list[int]] = {k: [] for k in table}
            for kind, ident, _data in c.messages[:-1]:
                got[kind].append(int(ident.split(".")[table[kind]]))
            for kind, ids in stored.items():
                assert got[kind] == [i for i in ids if i > c.start[table[kind]]], (kind, c.start)
        await _until(lambda: not streams.pollers)

    asyncio.run(main())


def test_slow_client_is_dropped_and_its_rows_freed(hard_settings: Callable[..., Settings], tmp_path: Path) -> None:
    settings, factory, job_id = _setup(hard_settings, tmp_path, sse_queue_max=5)

    async def main() -> None:
        streams = JobStreams(settings.sse_poll_s)
        fast = Client(job_id, [0, 0, 0], factory, streams, settings)
        await _until(lambda: job_id in streams.pollers)
        # the poller must have read its start heads before any row is written: `slow` joins bare (no catch-up read of
        # its own), so rows the heads already covered would never reach it
        await _until(lambda: streams.pollers[job_id].ready.is_set())
        slow = Subscriber(job_id, [0, 0, 0], Mailbox(settings.sse_queue_max))  # joins, never reads
        poller = streams.join(slow, factory)
        for first in (1, 3):  # two reads of 4 rows: the first fits the empty mailbox, the second overflows it
            with factory() as s:
                for step in (first, first + 1):
                    crud.upsert_metrics(s, job_id, [(step, "reward/mean", 1.0), (step, "actor/kl", 0.1)])
                s.commit()
            await _until(partial(lambda c, n: sum(m[0] == "metric" for m in c.messages) == n, fast, 2 * first + 2))
        await _until(lambda: slow.mailbox.closed is not None)
        assert "too slowly" in (slow.mailbox.closed or "") and len(slow.mailbox) == 0
        assert slow not in poller.subscribers and fast.sub in poller.subscribers
        await _until(lambda: sum(m[0] == "metric" for m in fast.messages) == 8)
        await fast.close()
        await _until(lambda: not streams.pollers)

    asyncio.run(main())


def test_poller_stops_when_the_last_stream_leaves(hard_settings: Callable[..., Settings], tmp_path: Path) -> None:
    settings, factory, job_id = _setup(hard_settings, tmp_path)
    polls = _count_polls(factory)

    async def main() -> None:
        streams = JobStreams(settings.sse_poll_s)
        a, b = (Client(job_id, [0, 0, 0], factory, streams, settings) for _ in range(2))
        await _until(lambda: job_id in streams.pollers and len(streams.pollers[job_id].subscribers) == 2)
        poller = streams.pollers[job_id]
        await a.close()
        assert poller.subscribers == {b.sub} and streams.pollers[job_id] is poller  # b still followed
        await b.close()
        assert not streams.pollers and not poller.subscribers
        assert poller.task is not None
        await asyncio.gather(poller.task, return_exceptions=True)
        n = polls[0]
        await asyncio.sleep(5 * POLL_S)
        assert polls[0] == n  # nothing polls any more
        c = Client(job_id, [0, 0, 0], factory, streams, settings)  # a new stream starts a new poller
        await _until(lambda: job_id in streams.pollers and streams.pollers[job_id] is not poller)
        await c.close()
        await streams.close()

    asyncio.run(main())
