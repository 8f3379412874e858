"""Dataset uploads: JSONL and Parquet validated for the prompt/answer columns, bad rows reported by number with
nothing stored, size limit 413, wrong type 415; a job can name the uploaded dataset."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
from fastapi.testclient import TestClient


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _jsonl(rows: list) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def test_upload_jsonl_and_use_in_job(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    body = _jsonl([{"question": "1+1?", "answer": "#### 2"},
                   {"question": [{"role": "user", "content": "2+2?"}], "answer": 4}])
    r = cp_client.post("/api/v1/datasets", files={"file": ("math.jsonl", body)}, headers=h)
    assert r.status_code == 201, r.text
    ds = r.json()
    assert ds["num_rows"] == 2 and ds["format"] == "jsonl" and ds["columns"] == ["question", "answer"]
    assert cp_client.get("/api/v1/datasets", headers=h).json()[0]["id"] == ds["id"]
    spec = {"model": {"builtin": "tiny-llama"}, "algorithm": {"max_completion_length": 8}, "dataset": {"dataset_id": ds["id"]}}
    assert cp_client.post("/api/v1/jobs", json={"spec": spec}, headers=h).status_code == 201
    # another user can neither see nor use it
    other = auth(cp_backend.token("bob"))
    assert cp_client.get(f"/api/v1/datasets/{ds['id']}", headers=other).status_code == 404
    assert cp_client.post("/api/v1/jobs", json={"spec": spec}, headers=other).status_code == 422


def test_bad_rows_are_reported_and_nothing_kept(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    body = _jsonl([{"question": "ok", "answer": "1"}, "{not json", {"question": "", "answer": "2"},
                   {"prompt": "x", "answer": "3"}, [1, 2]])
    r = cp_client.post("/api/v1/datasets", files={"file": ("d.jsonl", body)}, headers=h)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert "4 bad row(s) of 5" in detail["message"]
    assert [e.split(":")[0] for e in detail["errors"]] == ["row 2", "row 3", "row 4", "row 5"]
    assert cp_client.get("/api/v1/datasets", headers=h).json() == []
    store = cp_backend.settings.artifacts / "datasets"
    assert not store.exists() or list(store.iterdir()) == []


def test_parquet_custom_columns_and_limits(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    buf = io.BytesIO()
    pq.write_table(pa.table({"problem": ["a", "b", None], "solution": ["1", "2", "3"]}), buf)
    files = {"file": ("p.parquet", buf.getvalue())}
    form = {"prompt_column": "problem", "answer_column": "solution"}
    r = cp_client.post("/api/v1/datasets", files=files, data=form, headers=h)
    assert r.status_code == 422 and r.json()["detail"]["errors"] == ["row 3: column 'problem' is missing or empty"]
    buf = io.BytesIO()
    pq.write_table(pa.table({"problem": ["a", "b"], "solution": ["1", "2"]}), buf)
    r = cp_client.post("/api/v1/datasets", files={"file": ("p.parquet", buf.getvalue())}, data=form, headers=h)
    assert r.status_code == 201 and r.json()["num_rows"] == 2 and r.json()["prompt_column"] == "problem"
    r = cp_client.post("/api/v1/datasets", files={"file": ("p.parquet", b"garbage")}, headers=h)
    assert r.status_code == 422 and "cannot read" in r.json()["detail"]
    r = cp_client.post("/api/v1/datasets", files={"file": ("x.csv", b"a,b\n")}, headers=h)
    assert r.status_code == 415
    big = _jsonl([{"question": "q" * 1000, "answer": "a"}] * 1100)  # > 1 MiB limit of the test settings
    r = cp_client.post("/api/v1/datasets", files={"file": ("big.jsonl", big)}, headers=h)
    assert r.status_code == 413
    assert len(cp_client.get("/api/v1/datasets", headers=h).json()) == 1
