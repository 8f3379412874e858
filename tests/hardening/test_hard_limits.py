"""Limits: JSON body size (413 with a message, declared or streamed), dataset upload size, dataset validation that
names the bad rows and columns, artifact download immune to path traversal (crafted DB rows and URLs), and the
per-user job-submission rate limit (429 + Retry-After).

Run: python -m pytest tests/hardening/test_hard_limits.py -q
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi import HTTPException

from backend.core.limits import SubmitLimiter
from backend.persistence import crud
from tests.specs import api_spec

SPEC = api_spec()

def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}



def _chunks(data: bytes, size: int = 4096) -> Iterator[bytes]:
    """A body without Content-Length (chunked)."""
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_json_body_limit(make_env) -> None:  # type: ignore[no-untyped-def]
    env: Any = make_env(max_body_kb=8)
    h = {**auth(env.token()), "Content-Type": "application/json"}
    big = json.dumps({"spec": {**SPEC, "name": "x" * 10_000}}).encode()
    r = env.client.post("/api/v1/jobs", content=big, headers=h)
    assert r.status_code == 413 and "exceeds the limit of 8192 bytes" in r.json()["detail"]
    r = env.client.post("/api/v1/jobs", content=_chunks(big), headers=h)  # no Content-Length: counted as it streams
    assert r.status_code == 413 and "exceeds the limit" in r.json()["detail"]
    r = env.client.post("/api/v1/tokens", content=_chunks(b'{"user": "' + b"a" * 9000 + b'"}'), headers=h)
    assert r.status_code == 413
    assert env.client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).status_code == 201  # small is fine
    with env.session() as s:
        assert len(crud.list_jobs(s, crud.get_or_create_user(s, "alice"))[0]) == 1  # the big ones left nothing


def test_upload_size_limit(make_env) -> None:  # type: ignore[no-untyped-def]
    env: Any = make_env(max_upload_mb=0.25, max_body_kb=8)  # uploads have their own (larger) limit
    h = auth(env.token())
    row = json.dumps({"question": "q" * 100, "answer": "a"}).encode() + b"\n"
    ok = row * 1000  # ~110 KB: above the JSON limit, below the upload limit
    assert env.client.post("/api/v1/datasets", files={"file": ("ok.jsonl", ok)}, headers=h).status_code == 201
    big = row * 3000  # ~330 KB
    r = env.client.post("/api/v1/datasets", files={"file": ("big.jsonl", big)}, headers=h)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["detail"]
    # multipart body streamed without Content-Length
    boundary = "bnd"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + big + f"\r\n--{boundary}--\r\n".encode()
    r = env.client.post("/api/v1/datasets", content=_chunks(body, 65536),
                        headers={**h, "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 413
    assert [d["name"] for d in env.client.get("/api/v1/datasets", headers=h).json()] == ["ok.jsonl"]
    assert len(os.listdir(env.settings.artifacts / "datasets")) == 1  # rejected uploads left no file


def test_dataset_validation_names_rows_and_columns(env: Any) -> None:
    h = auth(env.token())
    rows = [{"question": "ok", "answer": "1"}, {"question": "", "answer": ""}, {"answer": "3"},
            {"question": [{"role": "user"}], "answer": "4"}, {"question": "fine", "answer": "5"}]
    body = "\n".join(json.dumps(r) for r in rows).encode() + b"\n{broken\n"
    r = env.client.post("/api/v1/datasets", files={"file": ("d.jsonl", body)}, headers=h)
    assert r.status_code == 422
    d = r.json()["detail"]
    assert d["bad_rows"] == [2, 3, 4, 6] and "4 bad row(s) of 6" in d["message"]  # row 2 counted once
    assert d["bad_columns"] == {"question": 3, "answer": 1}
    assert set(d["columns"]) == {"question", "answer"}
    assert any(e.startswith("row 6: not valid JSON") for e in d["errors"])
    buf = io.BytesIO()
    pq.write_table(pa.table({"problem": ["a", "b"], "solution": ["1", "2"]}), buf)
    r = env.client.post("/api/v1/datasets", files={"file": ("p.parquet", buf.getvalue())}, headers=h)  # default cols
    d = r.json()["detail"]
    assert r.status_code == 422 and d["bad_columns"] == {"question": 2, "answer": 2} and d["bad_rows"] == [0]
    assert d["columns"] == ["problem", "solution"] and "2 bad row(s) of 2" in d["message"]


def test_artifact_download_refuses_path_traversal(make_env, tmp_path) -> None:  # type: ignore[no-untyped-def]
    dist = tmp_path / "www" / "dist"  # a dashboard beside the secret: the static files must not reach it either
    dist.mkdir(parents=True)
    (dist / "index.html").write_text("<html>dashboard</html>")
    (tmp_path / "www" / "secret.txt").write_bytes(b"top secret")
    env: Any = make_env(frontend_dir=dist)
    h = auth(env.token())
    job = env.client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    root = env.settings.artifacts
    secret = root.parent / "secret.txt"  # beside the artifact dir, not in it
    secret.write_bytes(b"top secret")
    evil_sibling = root.parent / (root.name + "-evil")  # a prefix match is not containment
    evil_sibling.mkdir()
    (evil_sibling / "f").write_bytes(b"top secret")
    link = root / "runs" / "link.bin"  # a symlink inside the store pointing out of it
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(secret)
    crafted = [str(root / "runs" / ".." / ".." / "secret.txt"), str(evil_sibling / "f"), str(link),
               "../secret.txt", str(secret), "/etc/passwd"]
    digest = hashlib.sha256(b"top secret").hexdigest()
    with env.session() as s:
        for p in crafted:
            crud.register_artifact(s, job, kind="policy", path=p, is_dir=False, size=10, sha256=digest, step=None)
        s.commit()
        ids = [a.id for a in crud.list_artifacts(s, job)]
    assert len(ids) == len(crafted)
    for art_id in ids:
        r = env.client.get(f"/api/v1/artifacts/{art_id}/download", headers=h)
        assert r.status_code == 403 and b"top secret" not in r.content, (art_id, r.status_code)
    for url in ("/api/v1/artifacts/..%2F..%2Fsecret.txt/download", "/api/v1/artifacts/1%2F..%2F..%2Fsecret.txt/download",
                "/api/v1/artifacts/../../secret.txt", "/api/v1/artifacts/%2e%2e/download",
                "/api/v1/artifacts/1/download/../../../secret.txt", "/api/v1/..%2F..%2Fsecret.txt"):
        r = env.client.get(url, headers=h)
        assert r.status_code in (404, 422) and b"top secret" not in r.content, (url, r.status_code)
    for url in ("/..%2Fsecret.txt", "/..%2F..%2Fsecret.txt", "/%2e%2e/secret.txt", "/../secret.txt"):
        r = env.client.get(url)  # outside /api: the dashboard answers with its index page (client-side routes)
        assert b"top secret" not in r.content and r.status_code in (200, 404), (url, r.status_code)
        assert r.status_code == 404 or b"dashboard" in r.content


def test_submission_rate_limit(make_env) -> None:  # type: ignore[no-untyped-def]
    env: Any = make_env(submit_rate_per_min=6, submit_burst=3)
    a1, a2 = auth(env.token("alice")), auth(env.token("alice"))
    codes = [env.client.post("/api/v1/jobs", json={"spec": SPEC}, headers=a1).status_code for _ in range(4)]
    assert codes == [201, 201, 201, 429]
    r = env.client.post("/api/v1/jobs", json={"spec": SPEC}, headers=a1)
    assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 10 and "rate limit" in r.json()["detail"]
    assert env.client.post("/api/v1/jobs", json={"spec": SPEC}, headers=a2).status_code == 429  # per user
    bob = auth(env.token("bob"))
    assert env.client.post("/api/v1/jobs", json={"spec": SPEC}, headers=bob).status_code == 201
    assert env.client.get("/api/v1/jobs", headers=a1).status_code == 200  # reads are not limited
    with env.session() as s:
        assert len(crud.list_jobs(s, crud.get_or_create_user(s, "alice"))[0]) == 3  # 429s created nothing


def test_rate_limiter_refills() -> None:
    now = [0.0]
    lim = SubmitLimiter(per_min=60, burst=2, clock=lambda: now[0])
    lim.check("k")
    lim.check("k")
    with pytest.raises(HTTPException) as e:
        lim.check("k")
    assert e.value.status_code == 429 and e.value.headers == {"Retry-After": "1"}
    now[0] = 1.0  # one second refills one submission at 60/min
    lim.check("k")
    with pytest.raises(HTTPException):
        lim.check("k")
    SubmitLimiter(per_min=0, burst=1).check("k")  # 0 = unlimited


def test_download_header_safe_for_odd_file_names(env: Any) -> None:
    h = auth(env.token())
    job = env.client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    odd = env.settings.artifacts / "runs" / 'we"ird\nnäme.bin'
    odd.parent.mkdir(parents=True, exist_ok=True)
    odd.write_bytes(b"data")
    with env.session() as s:
        crud.register_artifact(s, job, kind="policy", path=str(odd), is_dir=False, size=4,
                               sha256=hashlib.sha256(b"data").hexdigest(), step=None)
        s.commit()
        art_id = crud.list_artifacts(s, job)[0].id
    r = env.client.get(f"/api/v1/artifacts/{art_id}/download", headers=h)
    assert r.status_code == 200 and r.content == b"data"
    assert r.headers["content-disposition"] == (
        "attachment; filename=\"we_ird_n_me.bin\"; filename*=UTF-8''we%22ird%0An%C3%A4me.bin")
