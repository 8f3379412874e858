"""What the dashboard asked of the API: `stream_cursor` on GET /metrics (history, then the SSE stream from that point
with no metric row lost or replayed), each job's `last_step` / `last_step_time_s` on the job list (one query per page,
served by indexes), and GET /histograms thinned by `points` and cut to the newest `limit`.

Run: python -m pytest tests/backend/test_cp_api_dashboard_feeds.py -q   (SQLite and Postgres, ~10 s)
"""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, func, select

from backend.lifecycle import JobStatus
from backend.persistence import crud
from backend.persistence.models import Metric
from tests.specs import api_spec

SPEC = api_spec(name="t", max_steps=2)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _job(client: TestClient, h: dict[str, str]) -> int:
    return client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]


def _sse(raw: str) -> list[dict]:
    out = []
    for block in raw.strip().split("\n\n"):
        msg = dict(line.partition(": ")[::2] for line in block.splitlines())
        if "event" in msg:
            out.append({"event": msg["event"], "id": msg.get("id"), "data": json.loads(msg["data"])})
    return out


def _steps(s, jid: int, steps: range, names: tuple[str, ...] = ("reward/mean", "timing_s/step")) -> None:
    crud.upsert_metrics(s, jid, [(st, n, st / 10) for st in steps for n in names])
    s.commit()


# ---------------------------------------------------------------- 1. stream_cursor


def test_stream_cursor_resumes_after_history(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    jid, other = _job(cp_client, h), _job(cp_client, h)
    r = cp_client.get(f"/api/v1/jobs/{jid}/metrics", headers=h).json()
    assert r["stream_cursor"] == "0.0.0" and r["series"] == [] and r["last_step"] is None
    with cp_backend.session() as s:
        crud.transition(s, jid, JobStatus.starting, worker="w1", new_attempt=True)
        crud.transition(s, jid, JobStatus.running)
        _steps(s, jid, range(1, 51))
        _steps(s, other, range(1, 5))  # another job's newer rows do not move this job's cursor
        crud.add_logs(s, jid, 1, ["step 50 done"])
        s.commit()
        newest = s.scalar(select(func.max(Metric.id)).where(Metric.job_id == jid))
    hist = cp_client.get(f"/api/v1/jobs/{jid}/metrics", params={"points": 10}, headers=h).json()
    assert hist["stream_cursor"] == f"{newest}.0.0" and hist["last_step"] == 50
    with cp_backend.session() as s:  # written after the history was read
        _steps(s, jid, range(51, 54))
        crud.transition(s, jid, JobStatus.succeeded, reason="done")
    msgs = _sse(cp_client.get(f"/api/v1/jobs/{jid}/stream",
                              headers={**h, "Last-Event-ID": hist["stream_cursor"]}).text)
    metric_steps = sorted({m["data"]["step"] for m in msgs if m["event"] == "metric"})
    assert metric_steps == [51, 52, 53]  # not the 100 rows the history already covered
    assert sum(m["event"] == "metric" for m in msgs) == 6
    # events and logs are not in a metrics history: the stream still delivers them from their start
    assert [m["data"]["to_status"] for m in msgs if m["event"] == "event"] == [
        "queued", "starting", "running", "succeeded"]
    assert [m["data"]["line"] for m in msgs if m["event"] == "log"] == ["step 50 done"]
    assert msgs[-1]["event"] == "end"
    # the same cursor works as ?last_event_id= too; a filtered history carries the job's cursor all the same
    filtered = cp_client.get(f"/api/v1/jobs/{jid}/metrics", params={"names": "reward/mean", "after_step": 52},
                             headers=h).json()
    again = _sse(cp_client.get(f"/api/v1/jobs/{jid}/stream", params={"last_event_id": filtered["stream_cursor"]},
                               headers=h).text)
    assert [m["event"] for m in again if m["event"] in ("metric", "end")] == ["end"]


def test_stream_cursor_read_before_history(cp_client: TestClient, cp_backend, monkeypatch) -> None:
    """A row committed between the cursor and the history query is delivered twice, never lost."""
    h = auth(cp_backend.token())
    jid = _job(cp_client, h)
    with cp_backend.session() as s:
        _steps(s, jid, range(1, 3), names=("reward/mean",))
    real = crud.metric_history

    def racing(session, *args, **kwargs):  # type: ignore[no-untyped-def]
        with cp_backend.session() as w:
            _steps(w, jid, range(3, 4), names=("reward/mean",))
        return real(session, *args, **kwargs)

    monkeypatch.setattr(crud, "metric_history", racing)
    hist = cp_client.get(f"/api/v1/jobs/{jid}/metrics", headers=h).json()
    monkeypatch.undo()
    assert [p["step"] for p in hist["series"][0]["points"]] == [1, 2, 3]
    with cp_backend.session() as s:
        crud.transition(s, jid, JobStatus.cancelled, reason="stop")
    msgs = _sse(cp_client.get(f"/api/v1/jobs/{jid}/stream", headers={**h, "Last-Event-ID": hist["stream_cursor"]}).text)
    assert [m["data"]["step"] for m in msgs if m["event"] == "metric"] == [3]


# ---------------------------------------------------------------- 2. last_step / last_step_time_s


def _count_metric_queries(engine: Engine) -> list[str]:
    seen: list[str] = []

    def hook(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if "metrics" in statement:
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", hook)
    return seen


def test_job_list_progress_in_one_query(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    plain, ahead, nan, empty = (_job(cp_client, h) for _ in range(4))
    with cp_backend.session() as s:
        _steps(s, plain, range(0, 30))
        _steps(s, ahead, range(0, 8))
        crud.upsert_metrics(s, ahead, [(8, "reward/mean", 1.0)])  # step 8 has no timing_s/step (yet)
        crud.upsert_metrics(s, nan, [(3, "timing_s/step", math.nan), (2, "timing_s/step", 0.5)])
        s.commit()
    engine = cp_client.app.state.session_factory.kw["bind"]  # type: ignore[attr-defined]
    seen = _count_metric_queries(engine)
    items = cp_client.get("/api/v1/jobs", headers=h).json()["items"]
    assert len(seen) == 1, seen  # one query for the whole page, not one per job
    got = {j["id"]: (j["last_step"], j["last_step_time_s"]) for j in items}
    assert got == {plain: (29, pytest.approx(2.9)), ahead: (8, pytest.approx(0.7)), nan: (3, None),
                   empty: (None, None)}
    for _ in range(3):
        _job(cp_client, h)
    seen.clear()
    assert len(cp_client.get("/api/v1/jobs", headers=h).json()["items"]) == 7 and len(seen) == 1
    one = cp_client.get(f"/api/v1/jobs/{plain}", headers=h).json()
    assert (one["last_step"], one["last_step_time_s"]) == (29, pytest.approx(2.9))
    cancelled = cp_client.post(f"/api/v1/jobs/{ahead}/cancel", headers=h).json()
    assert cancelled["status"] == "cancelled" and cancelled["last_step"] == 8
    assert cp_client.post(f"/api/v1/jobs/{ahead}/retry", headers=h).json()["last_step"] == 8


def test_progress_and_cursor_queries_use_indexes(cp_client: TestClient, cp_backend) -> None:
    """On analysed tables (2 jobs x 100 steps x 20 names), the planner serves the cursor and the progress lookups
    from indexes (Postgres with sequential scans ruled out; SQLite's own plan): no full scan of metrics, so the cost
    does not grow with a job's metric rows."""
    h = auth(cp_backend.token())
    jids = [_job(cp_client, h), _job(cp_client, h)]
    with cp_backend.session() as s:
        for jid in jids:
            _steps(s, jid, range(100), names=("timing_s/step", *(f"m{i}" for i in range(19))))
    engine = cp_backend.engine
    with engine.begin() as c:
        c.exec_driver_sql("ANALYZE metrics" if cp_backend.kind == "postgres" else "ANALYZE")
    captured: list[tuple[str, object]] = []

    def hook(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if "metrics" in statement:
            captured.append((statement, params))

    event.listen(engine, "before_cursor_execute", hook)
    try:
        with cp_backend.session() as s:
            crud.metrics_cursor(s, jids[0])
            crud.job_progress(s, jids)
    finally:
        event.remove(engine, "before_cursor_execute", hook)
    assert len(captured) == 2
    with engine.connect() as c:
        if cp_backend.kind == "postgres":
            c.exec_driver_sql("SET enable_seqscan = off")
            explain = "EXPLAIN "
        else:
            explain = "EXPLAIN QUERY PLAN "
        plans = ["\n".join(str(row[-1]) for row in c.exec_driver_sql(explain + sql, params))  # type: ignore[arg-type]
                 for sql, params in captured]
    cursor_plan, progress_plan = plans
    full_scan = "Seq Scan on metrics" if cp_backend.kind == "postgres" else "SCAN metrics"
    assert "ix_metrics_job_id_id" in cursor_plan and full_scan not in cursor_plan, cursor_plan
    assert "ix_metrics_job_name_step" in progress_plan and full_scan not in progress_plan, progress_plan


# ---------------------------------------------------------------- 3. histograms: points and limit


def test_histograms_points_and_limit(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    jid = _job(cp_client, h)
    with cp_backend.session() as s:
        for step in range(10):
            crud.upsert_histogram(s, jid, step, "response_length", [0, 10, 20], [step, 1])
        for step in (2, 5, 9):
            crud.upsert_histogram(s, jid, step, "reward", [0, 1], [step])
        s.commit()
    url = f"/api/v1/jobs/{jid}/histograms"

    def steps(**params: int) -> list[int]:
        r = cp_client.get(url, params={"name": "response_length", **params}, headers=h)
        assert r.status_code == 200, r.text
        return [x["step"] for x in r.json()]

    assert steps() == list(range(10))  # unchanged without the new parameters
    assert steps(points=4) == [0, 3, 6, 9]
    assert steps(points=1) == [9] and steps(points=10) == steps(points=500) == list(range(10))
    assert steps(limit=3) == [7, 8, 9]
    assert steps(points=4, limit=2) == [6, 9]  # the newest of the thinned ones
    assert steps(points=3, after_step=4) == [5, 7, 9]
    assert cp_client.get(url, params={"name": "response_length", "points": 1}, headers=h).json()[0]["counts"] == [9, 1]
    both = cp_client.get(url, params={"points": 2}, headers=h).json()  # each name thinned, ordered by step
    assert [(x["step"], x["name"]) for x in both] == [(0, "response_length"), (2, "reward"),
                                                        (9, "response_length"), (9, "reward")]
    tail = cp_client.get(url, params={"limit": 3}, headers=h).json()
    assert [(x["step"], x["name"]) for x in tail] == [(8, "response_length"), (9, "response_length"), (9, "reward")]
    for bad in ({"points": 0}, {"points": 10_001}, {"limit": 0}, {"limit": -1}, {"limit": 10_001},
                {"points": "many"}, {"limit": 1.5}):
        assert cp_client.get(url, params=bad, headers=h).status_code == 422, bad
