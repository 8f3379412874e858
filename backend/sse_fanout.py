"""SSE fan-out: one poller per job (per API process) reads the job's new metrics, events and log lines once per
`sse_poll_s` and hands them to every open stream of that job, so the database cost grows with the number of watched
jobs, not with the number of clients.

Exactness (Last-Event-ID resume): a row is identified by (table, id); every subscriber keeps its own cursor M.E.L and
takes a row only if its id is above the cursor for that table. A new stream first reads on its own from its cursor
until it has caught up, then joins the poller; the poller broadcasts only rows above its head, so if the subscriber
is behind the head when it joins it reads once more on its own. Whatever both paths deliver, the cursor filter keeps
once. Like the stream before it, this assumes a job's rows of one table commit in id order (one writer per table).

Memory is bounded: a subscriber's mailbox holds at most `sse_queue_max` rows; a client that falls that far behind is
closed cleanly (it reconnects with Last-Event-ID and misses nothing). The poller starts with the first subscriber
and stops when the last one leaves; no database connection is held between polls.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from backend.lifecycle import FINAL
from backend.persistence import crud
from backend.schemas import EventPublic, LogLinePublic

log = logging.getLogger(__name__)
BATCH = 500  # rows per table per read
METRICS, EVENTS, LOGS = 0, 1, 2  # positions in the cursor M.E.L
Cursor = tuple[int, int, int]


def format_cursor(cursor: Sequence[int]) -> str:
    """The message id / Last-Event-ID "M.E.L": the last row id seen of metrics, job_events and log_lines."""
    return f"{cursor[0]}.{cursor[1]}.{cursor[2]}"


@dataclass(frozen=True, slots=True)
class Row:
    table: int  # METRICS, EVENTS or LOGS
    id: int
    event: str  # the SSE event name
    data: str  # the JSON payload, serialised once for all subscribers


@dataclass(frozen=True, slots=True)
class End:
    status: str | None  # the job's final status (None: the job is gone)


@dataclass(frozen=True)
class Read:
    rows: list[Row]
    status: str | None
    drained: bool  # every table returned fewer than BATCH rows: nothing older is left to read

    @property
    def ended(self) -> bool:
        return self.drained and (self.status is None or self.status in FINAL)

    def items(self) -> list[Row | End]:
        return [*self.rows, End(self.status)] if self.ended else list(self.rows)


def read_after(factory: sessionmaker[Session], job_id: int, cursor: Sequence[int]) -> Read:
    """The job's rows after `cursor` (at most BATCH per table) and its status, in one short session. The status is
    read first: when it is final, every row written before it is in this read (or the next, if a batch was full)."""
    rows: list[Row] = []
    with factory() as s:
        status = crud.job_status(s, job_id)
        events = crud.list_events(s, job_id, cursor[EVENTS], BATCH)
        rows += (Row(EVENTS, ev.id, "event", json.dumps(EventPublic.model_validate(ev).model_dump(mode="json")))
                 for ev in events)
        metrics = crud.new_metrics(s, job_id, cursor[METRICS], BATCH)
        rows += (Row(METRICS, m.id, "metric",
                     json.dumps({"step": m.step, "name": m.name, "value": crud.finite_or_none(m.value)}))
                 for m in metrics)
        logs = crud.list_logs(s, job_id, cursor[LOGS], BATCH)
        rows += (Row(LOGS, lg.id, "log", json.dumps(LogLinePublic.model_validate(lg).model_dump(mode="json")))
                 for lg in logs)
    return Read(rows, status, drained=max(len(events), len(metrics), len(logs)) < BATCH)


def read_heads(factory: sessionmaker[Session], job_id: int) -> Cursor:
    with factory() as s:
        return crud.stream_heads(s, job_id)


class Mailbox:
    """A bounded queue of rows for one subscriber. `put` refuses (and closes the mailbox, freeing what it held) when
    rows are still waiting and the new ones would exceed `limit` (so it holds at most `limit` + one read's rows);
    `get` waits for rows, a close, or the timeout."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.closed: str | None = None  # why it was closed
        self._items: deque[Row | End] = deque()
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, items: Sequence[Row | End]) -> bool:
        if self.closed:
            return False
        if self._items and len(self._items) + len(items) > self.limit:  # one read's rows always fit an empty one
            self.close(f"more than {self.limit} rows waiting: the client reads too slowly")
            return False
        self._items.extend(items)
        self._ready.set()
        return True

    def close(self, why: str) -> None:
        self.closed = why
        self._items.clear()
        self._ready.set()

    async def get(self, timeout: float) -> list[Row | End]:
        """Everything waiting (empty on timeout or close)."""
        if not self._items and not self.closed:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                return []
        self._ready.clear()
        items = list(self._items)
        self._items.clear()
        return items


@dataclass(eq=False)
class Subscriber:
    """One open stream: its own cursor, its mailbox, and the SSE text it renders from shared rows."""

    job_id: int
    cursor: list[int]
    mailbox: Mailbox
    ended: bool = False  # `end` was rendered: the stream is over

    def render(self, items: Sequence[Row | End]) -> str:
        """The SSE text of the items above the cursor (and of `end`); advances the cursor."""
        out: list[str] = []
        for item in items:
            if isinstance(item, End):
                data = json.dumps({"status": item.status})
                out.append(f"event: end\nid: {format_cursor(self.cursor)}\ndata: {data}\n\n")
                self.ended = True
                break
            if item.id > self.cursor[item.table]:
                self.cursor[item.table] = item.id
                out.append(f"event: {item.event}\nid: {format_cursor(self.cursor)}\ndata: {item.data}\n\n")
        return "".join(out)

    def behind(self, head: Sequence[int]) -> bool:
        return any(c < h for c, h in zip(self.cursor, head, strict=True))


@dataclass(eq=False)
class JobPoller:
    """Polls one job for its subscribers; broadcast happens on the event loop, so a subscriber that joins between
    two broadcasts gets every row above the head it saw."""

    job_id: int
    factory: sessionmaker[Session]
    poll_s: float
    on_exit: Callable[[JobPoller], None]
    subscribers: set[Subscriber] = field(default_factory=set)
    head: list[int] = field(default_factory=lambda: [0, 0, 0])
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # head is known (or the poller failed)
    polls: int = 0  # reads made (tests and metrics)
    task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        try:
            self.head = list(await run_in_threadpool(read_heads, self.factory, self.job_id))
            self.ready.set()
            while self.subscribers:
                read = await run_in_threadpool(read_after, self.factory, self.job_id, tuple(self.head))
                self.polls += 1
                for row in read.rows:
                    self.head[row.table] = max(self.head[row.table], row.id)
                if items := read.items():
                    self.broadcast(items)
                if read.ended:
                    return
                if read.drained:
                    await asyncio.sleep(self.poll_s)
        except Exception as e:  # noqa: BLE001 - a database error closes the streams; clients resume by Last-Event-ID
            log.warning("SSE poller of job %s failed: %s", self.job_id, e)
            for sub in self.subscribers:
                sub.mailbox.close(f"database error: {type(e).__name__}")
        finally:
            self.ready.set()
            self.on_exit(self)

    def broadcast(self, items: Sequence[Row | End]) -> None:
        for sub in list(self.subscribers):
            if not sub.mailbox.put(items):
                log.info("SSE job %s: a subscriber was dropped (%s)", self.job_id, sub.mailbox.closed)
                self.subscribers.discard(sub)


class JobStreams:
    """The pollers of one API process, by job id (app.state.job_streams). Used from the event loop only."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self.pollers: dict[int, JobPoller] = {}

    def join(self, sub: Subscriber, factory: sessionmaker[Session]) -> JobPoller:
        poller = self.pollers.get(sub.job_id)
        if poller is None:
            poller = JobPoller(sub.job_id, factory, self.poll_s, self._exited)
            self.pollers[sub.job_id] = poller
            poller.subscribers.add(sub)
            poller.task = asyncio.get_running_loop().create_task(poller.run(), name=f"sse-poller-{sub.job_id}")
        else:
            poller.subscribers.add(sub)
        return poller

    def leave(self, sub: Subscriber, poller: JobPoller) -> None:
        poller.subscribers.discard(sub)
        if not poller.subscribers:  # the last one left: stop polling now
            self._exited(poller)
            if poller.task is not None:
                poller.task.cancel()

    def _exited(self, poller: JobPoller) -> None:
        if self.pollers.get(poller.job_id) is poller:
            del self.pollers[poller.job_id]

    async def close(self) -> None:
        tasks = [p.task for p in self.pollers.values() if p.task is not None]
        self.pollers.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
