"""The `tlt` CLI against the real API (FastAPI TestClient as the transport): a refused spec prints one
`field: message` line per error and the URL, an unreachable server is named, `submit --preset` sends the preset with
a file's keys on top, `logs -f` prints step lines in order with the final status last, and a downloaded directory's
files carry the artifact's creation time rather than the canonical tar's 1970.

Run: python -m pytest tests/backend/test_cp_cli.py -q
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from backend import artifact_store
from backend.lifecycle import JobStatus
from backend.persistence import crud
from worker import cli
from worker.cli import jobs as cli_jobs
from worker.client import TltClient
from worker.tlt.config import PRESETS

sqlite_only = pytest.mark.parametrize("cp_backend", ["sqlite"], indirect=True)  # the client, not the database, is tested


@pytest.fixture
def use_api(cp_client: TestClient, cp_backend: Any, monkeypatch: pytest.MonkeyPatch) -> TltClient:
    """Point every CLI command at the in-process API."""
    client = TltClient("http://testserver", None)
    cp_client.base_url = str(client.http.base_url)  # the TestClient is an httpx.Client serving the app in-process
    cp_client.headers["Authorization"] = f"Bearer {cp_backend.token(admin=True)}"
    client.http = cp_client
    monkeypatch.setattr(cli_jobs, "_client", lambda args: client)
    return client


@sqlite_only
def test_refused_spec_prints_field_lines_and_url(use_api: TltClient, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(yaml.safe_dump({"model": {"builtin": "tiny-llama"}, "algorithm": {"max_completion_length": 0},
                                    "max_steps": 0}))
    assert cli.main(["submit", str(spec)]) == cli.EXIT_API
    err = capsys.readouterr().err
    assert "HTTP 422 from http://testserver/api/v1/jobs" in err
    lines = [ln.strip() for ln in err.splitlines()]
    assert "spec.algorithm.max_completion_length: Input should be greater than or equal to 1" in lines
    assert "spec.max_steps: Input should be greater than or equal to 1" in lines
    assert "'loc'" not in err  # not the raw list


def test_unreachable_api_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["jobs", "--url", "http://127.0.0.1:9", "--token", "t"]) == cli.EXIT_API
    assert "cannot reach the TLT API at http://127.0.0.1:9" in capsys.readouterr().err


@sqlite_only
def test_submit_preset_with_file_overrides(use_api: TltClient, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    over = tmp_path / "over.yaml"
    over.write_text(yaml.safe_dump({"max_steps": 7, "algorithm": {"learning_rate": 0.5}}))
    assert cli.main(["submit", "--preset", "toy-cpu", str(over)]) == 0
    job_id = int(capsys.readouterr().out.split()[1])
    spec = use_api.job(job_id)["spec"]
    assert spec["name"] == PRESETS["toy-cpu"]["name"] and spec["max_steps"] == 7
    assert spec["algorithm"]["learning_rate"] == 0.5  # the file's key ...
    assert spec["algorithm"]["reward_funcs"] == ["toy_count"]  # ... over the preset's section, which keeps the rest
    assert cli.main(["submit", "--preset", "no-such"]) == cli.EXIT_API
    assert "unknown preset 'no-such'" in capsys.readouterr().err
    assert cli.main(["submit"]) == cli.EXIT_API


@sqlite_only
def test_logs_follow_prints_final_status_last(use_api: TltClient, cp_backend: Any,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    job_id = use_api.submit(PRESETS["toy-cpu"])["id"]
    with cp_backend.session() as s:
        crud.transition(s, job_id, JobStatus.starting, worker="w", new_attempt=True)
        crud.transition(s, job_id, JobStatus.running, worker="w")
        s.commit()
        crud.add_logs(s, job_id, 1, ["step 1/2 reward 0.1", "step 2/2 reward 0.3"])
        s.commit()
        crud.transition(s, job_id, JobStatus.succeeded, worker="w")
        s.commit()
    assert cli.main(["logs", "-f", str(job_id)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out.index("-- running") < out.index("step 1/2 reward 0.1") < out.index("step 2/2 reward 0.3")
    assert out[-1] == "-- succeeded"
    assert cli.main(["logs", str(job_id)]) == 0  # without -f: the lines, then the outcome
    assert capsys.readouterr().out.splitlines() == ["step 1/2 reward 0.1", "step 2/2 reward 0.3", "-- succeeded"]


@sqlite_only
def test_submit_wait_prints_each_step_then_the_outcome(use_api: TltClient, cp_backend: Any,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    submitted = use_api.submit

    def submit_and_run(spec: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        job = submitted(spec, idempotency_key)  # then a worker runs it: two steps, succeeded
        with cp_backend.session() as s:
            crud.transition(s, job["id"], JobStatus.starting, worker="w", new_attempt=True)
            crud.transition(s, job["id"], JobStatus.running, worker="w")
            s.commit()
            crud.add_logs(s, job["id"], 1, ["step 1/2 reward 0.1", "step 2/2 reward 0.3"])
            crud.transition(s, job["id"], JobStatus.succeeded, worker="w")
            s.commit()
        return job

    monkeypatch.setattr(use_api, "submit", submit_and_run)
    assert cli.main(["submit", "--preset", "toy-cpu", "--wait"]) == 0
    out = capsys.readouterr().out.splitlines()
    job_id = use_api.jobs(limit=1)[0]["id"]
    assert out[0] == f"job {job_id} queued"
    assert out.index("step 1/2 reward 0.1") < out.index("step 2/2 reward 0.3") < out.index("-- succeeded")
    assert out[-1] == f"job {job_id} succeeded"


def test_client_subcommands_document_url_and_token(capsys: pytest.CaptureFixture[str]) -> None:
    for sub in ("submit", "jobs", "logs", "metrics", "cancel", "download"):
        with pytest.raises(SystemExit):
            cli.main([sub, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--url URL the TLT Studio API (default: $TLT_URL" in text, sub
        assert "--token TOKEN API token, from `tlt token create` (default: $TLT_TOKEN)" in text, sub


@sqlite_only
def test_download_keeps_a_real_mtime_and_prints_the_path(use_api: TltClient, cp_backend: Any, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    job_id = use_api.submit(PRESETS["toy-cpu"])["id"]
    d = cp_backend.settings.artifacts / "jobs" / str(job_id) / "policy"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "sub" / "w.bin").write_bytes(b"\0" * 10)
    size, sha, is_dir = artifact_store.digest(d)
    with cp_backend.session() as s:
        crud.register_artifact(s, job_id, kind="policy", path=str(d), is_dir=is_dir, size=size, sha256=sha, step=1)
        s.commit()
    out = tmp_path / "dl"
    assert cli.main(["download", str(job_id), "--kind", "policy", "-o", str(out)]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == f"job {job_id} policy written to {(out / 'policy').resolve()}"  # the directory itself
    now = time.time()
    for f in (out / "policy" / "config.json", out / "policy" / "sub" / "w.bin", out / "policy" / "sub"):
        assert abs(os.stat(f).st_mtime - now) < 120, f  # the artifact's creation time, not 1970


def test_demo_summary_shows_first_last_and_highest() -> None:
    from worker.cli.up import demo_summary

    history = {"series": [
        {"name": "reward/mean", "points": [{"step": 1, "value": 0.35}, {"step": 7, "value": 0.81},
                                           {"step": 8, "value": 0.5}]},
        {"name": "sd/accept_len", "points": [{"step": 1, "value": None}]},  # never reported: no line
        {"name": "loss", "points": [{"step": 1, "value": 1.0}]},  # not a summary metric
    ]}
    (line,) = demo_summary(history)
    assert "step 1: 0.350" in line and "step 8: 0.500" in line and "highest 0.810 at step 7" in line


def test_switch_summary_says_why_sd_is_off() -> None:
    from worker.cli.up import switch_summary

    pts = lambda v: [{"step": 1, "value": None}, {"step": 2, "value": v}]  # noqa: E731 - the last value counts
    history = {"series": [{"name": "sd/pays/5-8", "points": pts(0.0)}, {"name": "sd/gain/5-8", "points": pts(0.62)},
                          {"name": "sd/step_s_plain/5-8", "points": pts(0.063)},
                          {"name": "sd/step_s_sd/5-8", "points": pts(0.101)},
                          {"name": "sd/on_fraction", "points": pts(0.5)}]}
    assert switch_summary(history) == ["  SD switch at 5-8 active: off (measured: plain step 63 ms, SD step 101 ms; "
                                       "SD gives 0.62x plain decoding's tokens/s per sequence)"]
    assert switch_summary({"series": [{"name": "sd/on_fraction", "points": pts(0.5)}]}) == []
