"""Metrics (idempotent upsert, names, after_step cursor, downsampling), histograms, logs, samples and the SSE stream
(delivers metric/event/log messages with ids, ends when the job is final, resumes from Last-Event-ID)."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from backend.lifecycle import JobStatus
from backend.persistence import crud
from tests.specs import api_spec

SPEC = api_spec(name="t", max_steps=2)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _job(client: TestClient, h: dict[str, str]) -> int:
    return client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]


def test_metrics_history(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    jid = _job(cp_client, h)
    with cp_backend.session() as s:
        for step in range(1, 11):
            crud.upsert_metrics(s, jid, [(step, "reward/mean", step / 10), (step, "actor/pg_loss", -step)])
        crud.upsert_metrics(s, jid, [(3, "reward/mean", 0.99), (3, "reward/mean", 0.33)])  # replayed step
        s.commit()
    assert cp_client.get(f"/api/v1/jobs/{jid}/metrics/names", headers=h).json() == ["actor/pg_loss", "reward/mean"]
    r = cp_client.get(f"/api/v1/jobs/{jid}/metrics", params={"names": "reward/mean"}, headers=h).json()
    (series,) = r["series"]
    assert [p["step"] for p in series["points"]] == list(range(1, 11))  # no duplicate for step 3
    assert series["points"][2]["value"] == 0.33 and r["last_step"] == 10
    r = cp_client.get(f"/api/v1/jobs/{jid}/metrics", params={"after_step": 7}, headers=h).json()
    assert {s["name"]: [p["step"] for p in s["points"]] for s in r["series"]} == {
        "actor/pg_loss": [8, 9, 10], "reward/mean": [8, 9, 10]}
    r = cp_client.get(f"/api/v1/jobs/{jid}/metrics", params=[("names", "actor/pg_loss"), ("points", 4)],
                      headers=h).json()
    pts = r["series"][0]["points"]
    assert len(pts) == 4 and pts[0]["step"] == 1 and pts[-1]["step"] == 10 and r["series"][0]["total"] == 10
    assert cp_client.get(f"/api/v1/jobs/{jid}/metrics", params={"points": 0}, headers=h).status_code == 422


def test_histograms_logs_samples(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    jid = _job(cp_client, h)
    with cp_backend.session() as s:
        crud.upsert_histogram(s, jid, 1, "response_length", [0, 10, 20], [3, 1])
        crud.upsert_histogram(s, jid, 1, "response_length", [0, 10, 20], [2, 2])  # idempotent
        crud.upsert_histogram(s, jid, 2, "response_length", [0, 10, 20], [0, 4])
        crud.add_logs(s, jid, 1, ["step 1 done", "step 2 done"])
        crud.add_samples(s, jid, 1, [{"prompt": "1+1", "response": "2", "reward": 1.0}])
        s.commit()
    hist = cp_client.get(f"/api/v1/jobs/{jid}/histograms", params={"name": "response_length"}, headers=h).json()
    assert [(x["step"], x["counts"]) for x in hist] == [(1, [2, 2]), (2, [0, 4])]
    logs = cp_client.get(f"/api/v1/jobs/{jid}/logs", headers=h).json()
    assert [x["line"] for x in logs] == ["step 1 done", "step 2 done"]
    after = cp_client.get(f"/api/v1/jobs/{jid}/logs", params={"after_id": logs[0]["id"]}, headers=h).json()
    assert [x["line"] for x in after] == ["step 2 done"]
    samples = cp_client.get(f"/api/v1/jobs/{jid}/samples", headers=h).json()
    assert samples[0]["rows"][0]["response"] == "2"
    other = auth(cp_backend.token("mallory"))
    for path in ("metrics", "metrics/names", "histograms", "logs", "samples", "events", "stream", "artifacts"):
        assert cp_client.get(f"/api/v1/jobs/{jid}/{path}", headers=other).status_code == 404, path


def _sse(text: str) -> list[dict]:
    out = []
    for block in text.strip().split("\n\n"):
        msg: dict = {}
        for line in block.splitlines():
            key, _, value = line.partition(": ")
            msg[key] = value
        if "event" in msg:
            out.append({"event": msg["event"], "id": msg.get("id"), "data": json.loads(msg["data"])})
    return out


def test_sse_stream_and_resume(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    jid = _job(cp_client, h)
    with cp_backend.session() as s:
        crud.transition(s, jid, JobStatus.starting, worker="w1", new_attempt=True)
        crud.transition(s, jid, JobStatus.running)
        crud.upsert_metrics(s, jid, [(1, "reward/mean", 0.5), (2, "reward/mean", 0.7)])
        crud.add_logs(s, jid, 1, ["hello"])
        s.commit()
        crud.transition(s, jid, JobStatus.succeeded, reason="done")
    r = cp_client.get(f"/api/v1/jobs/{jid}/stream", headers=h)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    msgs = _sse(r.text)
    kinds = [m["event"] for m in msgs]
    assert kinds.count("event") == 4 and kinds.count("metric") == 2 and kinds.count("log") == 1
    assert kinds[-1] == "end" and msgs[-1]["data"]["status"] == "succeeded"
    assert [m["data"]["to_status"] for m in msgs if m["event"] == "event"] == [
        "queued", "starting", "running", "succeeded"]
    assert all(m["id"] for m in msgs)
    # resume after the first metric: exactly the second metric and the log line follow
    first_metric = next(i for i, m in enumerate(msgs) if m["event"] == "metric")
    r2 = cp_client.get(f"/api/v1/jobs/{jid}/stream", headers={**h, "Last-Event-ID": msgs[first_metric]["id"]})
    rest = [(m["event"], m["data"].get("step"), m["data"].get("line")) for m in _sse(r2.text)]
    assert rest == [("metric", 2, None), ("log", None, "hello"), ("end", None, None)]
    r3 = cp_client.get(f"/api/v1/jobs/{jid}/stream", params={"last_event_id": msgs[-1]["id"]}, headers=h)
    assert [m["event"] for m in _sse(r3.text)] == ["end"]
    assert cp_client.get(f"/api/v1/jobs/{jid}/stream", headers={**h, "Last-Event-ID": "x"}).status_code == 400
