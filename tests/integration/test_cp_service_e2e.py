"""End to end through real processes: REST API (uvicorn) -> broker -> Celery worker -> training child -> database,
on Postgres + Redis (the SQLite + SQLAlchemy-broker path: test_cp_tlt_up.py). Checks the lifecycle and its events, metrics, artifact
download (sha256, Range, tar of a directory), SSE resume, auth/validation/idempotency/OpenAPI, and the `tlt` client.

Run: python -m pytest tests/integration/test_cp_service_e2e.py -q   (about a minute on 2 cores)
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import yaml

from worker import cli
from worker.client import TltClient, parse_sse

from .conftest import TINY_SPEC, Stack

pytestmark = pytest.mark.slow


def _transitions(stack: Stack, job_id: int) -> list[tuple[str | None, str, int, str | None]]:
    with stack.http() as c:
        events = c.get(f"/jobs/{job_id}/events").json()
    return [(e["from_status"], e["to_status"], e["attempt"], e["worker"]) for e in events if e["to_status"]]


def _run_lifecycle(stack: Stack) -> int:
    with stack.http() as c:
        r = c.post("/jobs", json={"spec": TINY_SPEC})
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["status"] == "queued"
    final = stack.wait_job(job["id"])
    assert final["status"] == "succeeded", f"{final}\n{stack.worker_logs()}"
    assert final["attempt"] == 1 and final["worker"].startswith("w0@")
    steps = _transitions(stack, job["id"])
    assert [(f, t) for f, t, _, _ in steps] == [
        (None, "queued"), ("queued", "starting"), ("starting", "running"), ("running", "succeeded")]
    assert all(a == 1 and w == final["worker"] for _, t, a, w in steps if t != "queued")
    with stack.http() as c:
        names = c.get(f"/jobs/{job['id']}/metrics/names").json()
        assert "reward/mean" in names and "actor/pg_loss" in names
        hist = c.get(f"/jobs/{job['id']}/metrics", params={"names": "reward/mean"}).json()
        assert [p["step"] for p in hist["series"][0]["points"]] == [1, 2]
        assert c.get(f"/jobs/{job['id']}/histograms").json(), "response_length histograms stored"
        arts = c.get(f"/jobs/{job['id']}/artifacts").json()
        assert {a["kind"] for a in arts} >= {"policy", "checkpoint"}
    return int(job["id"])


def test_lifecycle_on_postgres_and_redis(pg_stack: Stack) -> None:
    job_id = _run_lifecycle(pg_stack)
    with pg_stack.http() as c:
        # Artifact download: a directory is a tar stream whose sha256 is announced; Range serves exact slices.
        policy = next(a for a in c.get(f"/jobs/{job_id}/artifacts").json() if a["kind"] == "policy")
        full = c.get(f"/artifacts/{policy['id']}/download")
        assert full.status_code == 200 and len(full.content) == policy["size"]
        assert hashlib.sha256(full.content).hexdigest() == policy["sha256"] == full.headers["x-checksum-sha256"]
        names = tarfile.open(fileobj=io.BytesIO(full.content)).getnames()
        assert any(n.endswith("config.json") for n in names) and any(n.endswith(".safetensors") for n in names)
        part = c.get(f"/artifacts/{policy['id']}/download", headers={"Range": "bytes=100-1123"})
        assert part.status_code == 206 and part.content == full.content[100:1124]
        assert part.headers["content-range"] == f"bytes 100-1123/{policy['size']}"

        # SSE: the whole history, then a resume from the 5th message delivers exactly the rest.
        with c.stream("GET", f"/jobs/{job_id}/stream") as resp:
            everything = list(parse_sse(resp.iter_lines()))
        assert everything[-1].event == "end" and everything[-1].data["status"] == "succeeded"
        kinds = {e.event for e in everything}
        assert {"event", "metric", "log"} <= kinds
        with c.stream("GET", f"/jobs/{job_id}/stream", headers={"Last-Event-ID": everything[4].id}) as resp:
            rest = list(parse_sse(resp.iter_lines()))
        assert [(e.event, e.id) for e in rest] == [(e.event, e.id) for e in everything[5:]]


def test_auth_validation_idempotency_openapi(pg_stack: Stack) -> None:
    with pg_stack.http(token=None) as anon:
        assert anon.get(pg_stack.url + "/healthz").status_code == 200
        assert anon.get("/jobs").status_code == 401
        assert anon.post("/jobs", json={"spec": TINY_SPEC}).status_code == 401
    with pg_stack.http() as c:
        bad = {**TINY_SPEC, "algorithm": {"temperature": 0}}
        r = c.post("/jobs", json={"spec": bad})
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["body", "spec", "algorithm", "temperature"]
        spec = {**TINY_SPEC, "max_steps": 1, "name": "idem"}
        a = c.post("/jobs", json={"spec": spec}, headers={"Idempotency-Key": "ci-run-1"}).json()
        b = c.post("/jobs", json={"spec": spec}, headers={"Idempotency-Key": "ci-run-1"}).json()
        assert a["id"] == b["id"]
        assert [j["id"] for j in c.get("/jobs").json()["items"]].count(a["id"]) == 1
        for _ in range(5):  # cancel it to keep the worker free (409 while its status is changing under the request)
            r = c.post(f"/jobs/{a['id']}/cancel")
            if r.status_code == 200:
                break
            assert r.status_code == 409, r.text
        paths = set(c.get(pg_stack.url + "/openapi.json").json()["paths"])
    assert {"/healthz", "/metrics", "/api/v1/jobs", "/api/v1/jobs/{job_id}", "/api/v1/jobs/{job_id}/cancel",
            "/api/v1/jobs/{job_id}/retry", "/api/v1/jobs/{job_id}/metrics", "/api/v1/jobs/{job_id}/metrics/names",
            "/api/v1/jobs/{job_id}/histograms", "/api/v1/jobs/{job_id}/events", "/api/v1/jobs/{job_id}/logs",
            "/api/v1/jobs/{job_id}/samples", "/api/v1/jobs/{job_id}/stream", "/api/v1/jobs/{job_id}/artifacts",
            "/api/v1/artifacts/{artifact_id}/download", "/api/v1/datasets", "/api/v1/tokens",
            "/api/v1/tokens/{token_id}"} <= paths
    pg_stack.wait_job(a["id"])


def test_crash_fails_the_attempt_not_the_worker(pg_stack: Stack) -> None:
    """A child that dies (here: the model directory, inside the allowed roots, does not exist) fails the job with its
    error line (the traceback stays in the job's log); the same worker then runs the next job."""
    missing = f"{pg_stack.env['TLT_SPEC_ROOTS']}/nonexistent-model"
    with pg_stack.http() as c:
        bad = c.post("/jobs", json={"spec": {**TINY_SPEC, "name": "crash", "model": {"hf_dir": missing}}})
        job = pg_stack.wait_job(bad.json()["id"])
    assert job["status"] == "failed"
    assert "exited with status 1" in job["reason"] and "full output in the job's log" in job["reason"]
    assert "nonexistent-model" in job["reason"] and "Traceback" not in job["reason"]  # the error line names the cause
    assert pg_stack.workers[0].poll() is None, "the worker survived"
    with pg_stack.http() as c:  # retry: back to queued, enqueued again, run again by the same worker (attempt 2)
        assert c.post(f"/jobs/{job['id']}/retry").json()["status"] == "queued"
    again = pg_stack.wait_job(job["id"])
    assert (again["status"], again["attempt"]) == ("failed", 2)
    flow = [(t, a) for _, t, a, _ in _transitions(pg_stack, job["id"])]
    assert flow == [("queued", 0), ("starting", 1), ("running", 1), ("failed", 1),
                    ("queued", 1), ("starting", 2), ("running", 2), ("failed", 2)]


def test_cli_submit_wait_metrics_download_on_uploaded_data(pg_stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TLT_URL", pg_stack.url)
    monkeypatch.setenv("TLT_TOKEN", pg_stack.token)
    # The job trains on an uploaded dataset: upload -> id in the spec -> the worker resolves it to the stored file.
    rows = "".join(json.dumps({"q": f"What is {i} + {i}?", "a": f"#### {2 * i}"}) + "\n" for i in range(12))
    with pg_stack.http() as c:
        r = c.post("/datasets", files={"file": ("sums.jsonl", rows.encode())},
                   data={"prompt_column": "q", "answer_column": "a"})
    assert r.status_code == 201, r.text
    assert r.json()["num_rows"] == 12
    dataset = {"dataset_id": r.json()["id"], "prompt_column": "q", "answer_column": "a", "validation_size": 2}
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({**TINY_SPEC, "name": "cli", "max_steps": 1, "dataset": dataset}))
    assert cli.main(["submit", str(spec_file), "--wait", "--idempotency-key", "cli-1", "--poll", "0.3"]) == 0
    out = capsys.readouterr().out
    job_id = int(out.split()[1])
    assert f"job {job_id} succeeded" in out
    assert cli.main(["submit", str(spec_file), "--idempotency-key", "cli-1"]) == 0
    assert capsys.readouterr().out.split()[1] == str(job_id)  # same key: the same job
    assert cli.main(["metrics", str(job_id)]) == 0
    assert "reward/mean" in capsys.readouterr().out
    assert cli.main(["download", str(job_id), "--kind", "policy", "-o", str(tmp_path / "policy")]) == 0
    cfg = json.loads(next((tmp_path / "policy").rglob("config.json")).read_text())
    assert cfg["model_type"] in {"llama", "qwen2", "qwen3"}
    assert cli.main(["logs", str(job_id)]) == 0
    capsys.readouterr()
    assert cli.main(["logs", "-f", str(job_id)]) == 0  # SSE follow of a finished job: replays, then ends
    assert "-- succeeded" in capsys.readouterr().out
    assert cli.main(["jobs", "--url", pg_stack.url, "--token", "tlt_not_a_token"]) == cli.EXIT_API
    client = TltClient(pg_stack.url, pg_stack.token)
    assert client.job(job_id)["status"] == "succeeded"

