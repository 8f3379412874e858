"""Artifact downloads: sha256 headers match the bytes, Range requests (206/416), a directory as a canonical tar
stream (deterministic digest, extracts to the same files, resumable), 410 after retention, 403 outside the store."""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
from pathlib import Path

from fastapi.testclient import TestClient

from backend import artifact_store
from backend.persistence import crud
from tests.specs import api_spec

SPEC = api_spec(name="t")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _register(cp_backend, jid: int, kind: str, path: Path, step: int | None = None) -> int:
    size, sha, is_dir = artifact_store.digest(path)
    with cp_backend.session() as s:
        crud.register_artifact(s, jid, kind=kind, path=str(path), is_dir=is_dir, size=size, sha256=sha, step=step)
        s.commit()
        return next(a.id for a in crud.list_artifacts(s, jid) if a.path == str(path))


def test_file_download_with_range(cp_client: TestClient, cp_backend) -> None:
    h = auth(cp_backend.token())
    jid = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    f = cp_backend.settings.artifacts / "jobs" / str(jid) / "ckpt.bin"
    f.parent.mkdir(parents=True)
    data = bytes(range(256)) * 5000  # 1.28 MB: more than one streamed chunk
    f.write_bytes(data)
    aid = _register(cp_backend, jid, "checkpoint", f, step=3)
    arts = cp_client.get(f"/api/v1/jobs/{jid}/artifacts", headers=h).json()
    assert arts[0]["kind"] == "checkpoint" and arts[0]["size"] == len(data) and arts[0]["name"] == "ckpt.bin"
    r = cp_client.get(arts[0]["download_url"], headers=h)
    assert r.status_code == 200 and r.content == data
    assert r.headers["x-checksum-sha256"] == hashlib.sha256(data).hexdigest()
    assert r.headers["accept-ranges"] == "bytes" and r.headers["digest"].startswith("sha-256=")
    r = cp_client.get(f"/api/v1/artifacts/{aid}/download", headers={**h, "Range": "bytes=1000-1099"})
    assert r.status_code == 206 and r.content == data[1000:1100]
    assert r.headers["content-range"] == f"bytes 1000-1099/{len(data)}"
    r = cp_client.get(f"/api/v1/artifacts/{aid}/download", headers={**h, "Range": "bytes=-10"})
    assert r.status_code == 206 and r.content == data[-10:]
    r = cp_client.get(f"/api/v1/artifacts/{aid}/download", headers={**h, "Range": f"bytes={len(data)}-"})
    assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(data)}"
    assert cp_client.get(f"/api/v1/artifacts/{aid}/download", headers=auth(cp_backend.token("eve"))).status_code == 404
    f.unlink()
    assert cp_client.get(f"/api/v1/artifacts/{aid}/download", headers=h).status_code == 410


def test_directory_downloads_as_canonical_tar(cp_client: TestClient, cp_backend, tmp_path: Path) -> None:
    h = auth(cp_backend.token())
    jid = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    d = cp_backend.settings.artifacts / "jobs" / str(jid) / "policy"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(b"\x01" * 1500)
    (d / "sub" / "tokenizer.json").write_text("{}")
    aid = _register(cp_backend, jid, "policy", d)
    r = cp_client.get(f"/api/v1/artifacts/{aid}/download", headers=h)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    assert hashlib.sha256(r.content).hexdigest() == r.headers["x-checksum-sha256"]
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(tmp_path / "out", filter="data")
    out = tmp_path / "out" / "policy"
    assert (out / "model.safetensors").read_bytes() == b"\x01" * 1500
    assert (out / "sub" / "tokenizer.json").read_text() == "{}"
    # the digest does not depend on timestamps or on which copy is hashed
    copy = cp_backend.settings.artifacts / "copy" / "policy"
    shutil.copytree(d, copy)
    assert artifact_store.digest(copy)[:2] == artifact_store.digest(d)[:2]
    # resume a tar download half way
    half = len(r.content) // 2
    r2 = cp_client.get(f"/api/v1/artifacts/{aid}/download", headers={**h, "Range": f"bytes={half}-"})
    assert r2.status_code == 206 and r.content[:half] + r2.content == r.content


def test_artifact_outside_store_is_refused(cp_client: TestClient, cp_backend, tmp_path: Path) -> None:
    h = auth(cp_backend.token())
    jid = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    outside = tmp_path / "secret.txt"
    outside.write_text("no")
    aid = _register(cp_backend, jid, "policy", outside)
    assert cp_client.get(f"/api/v1/artifacts/{aid}/download", headers=h).status_code == 403
