"""A spec cannot read other users' data or the worker's files (findings 1 and 2 of the service-safety review), on
SQLite and Postgres: paths only inside TLT_SPEC_ROOTS and never inside the home or artifact store (even when a root
contains them), the same refusal text whether or not a path exists, artifacts and datasets by id only one's own (404
as missing), and the worker's own check before loading.

Run: python -m pytest tests/backend/test_cp_safety_paths.py -q
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backend.job_spec_paths import REFUSED
from backend.main import create_app
from backend.persistence import crud
from backend.worker_spec import SpecRefused, runnable_spec
from tests.specs import api_spec

SPEC = api_spec(name="t")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def rooted(cp_backend, tmp_path: Path) -> Iterator[TestClient]:
    """The API with TLT_SPEC_ROOTS = tmp_path, which also contains the home and its artifact store."""
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    settings = cp_backend.settings.model_copy(update={"spec_roots": f"/nonexistent-root{os.pathsep}{tmp_path}"})
    cp_backend.settings = settings
    with TestClient(create_app(settings)) as client:
        yield client


def _own_policy(cp_backend, client: TestClient, token: str, kind: str = "policy") -> tuple[int, int, Path]:
    """A finished job of `token`'s user with one registered artifact: (job id, artifact id, its path)."""
    jid = client.post("/api/v1/jobs", json={"spec": SPEC}, headers=auth(token)).json()["id"]
    path = cp_backend.settings.artifacts / "jobs" / str(jid) / kind
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    with cp_backend.session() as s:
        crud.register_artifact(s, jid, kind=kind, path=str(path), is_dir=True, size=2, sha256="0" * 64, step=1)
        s.commit()
        aid = next(a.id for a in crud.list_artifacts(s, jid))
    return jid, aid, path


def _post(client: TestClient, token: str, **over: object) -> tuple[int, object]:
    r = client.post("/api/v1/jobs", json={"spec": {**SPEC, **over}}, headers=auth(token))
    return r.status_code, r.json()


def test_another_users_policy_is_unreachable_by_path(rooted: TestClient, cp_backend) -> None:
    """Finding 1: bob names alice's exported policy by its path on the artifact store (inside the configured root):
    refused for hf_dir, gguf and drafter.warm_start, also through `..` and a symlink."""
    alice, bob = cp_backend.token("alice"), cp_backend.token("bob")
    _, _, theirs = _own_policy(cp_backend, rooted, alice)
    link = cp_backend.settings.home.parent / "models" / "link"
    link.symlink_to(theirs)
    dotdot = f"{cp_backend.settings.home.parent}/models/../{theirs.relative_to(cp_backend.settings.home.parent)}"
    for model in ({"hf_dir": str(theirs)}, {"gguf": str(theirs / "config.json")}, {"hf_dir": str(link)},
                  {"hf_dir": dotdot}):
        code, body = _post(rooted, bob, model=model)
        assert code == 422, (model, body)
        assert body["detail"][0]["msg"] == REFUSED  # type: ignore[index]
    code, body = _post(rooted, bob, drafter={"warm_start": str(theirs)})
    assert code == 422 and body["detail"][0]["loc"] == ["body", "spec", "drafter", "warm_start"]  # type: ignore[index]
    # the database and broker in the home are private too
    code, _ = _post(rooted, bob, dataset={"path": str(cp_backend.settings.home / "tlt.db")})
    assert code == 422


def test_artifact_ids_only_ones_own(rooted: TestClient, cp_backend) -> None:
    """Finding 1's replacement: `model: {artifact_id}` and `drafter.warm_start: {artifact_id}` continue from one's own
    artifacts; another user's id is the same 404 as a missing one; the worker resolves the id to the path."""
    alice, bob = cp_backend.token("alice"), cp_backend.token("bob")
    _, policy_id, policy_path = _own_policy(cp_backend, rooted, alice)
    _, drafter_id, drafter_path = _own_policy(cp_backend, rooted, alice, kind="drafter")
    theirs = rooted.post("/api/v1/jobs", json={"spec": {**SPEC, "model": {"artifact_id": policy_id}}}, headers=auth(bob))
    missing = rooted.post("/api/v1/jobs", json={"spec": {**SPEC, "model": {"artifact_id": 10**9}}}, headers=auth(bob))
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["detail"] == f"artifact {policy_id} not found"
    assert missing.json()["detail"] == f"artifact {10**9} not found"
    code, body = _post(rooted, alice, model={"artifact_id": drafter_id})  # a drafter is not a policy
    assert code == 422 and "is a drafter, not a policy" in body["detail"][0]["msg"]  # type: ignore[index]
    code, body = _post(rooted, alice, model={"artifact_id": policy_id}, drafter={"warm_start": {"artifact_id": drafter_id}})
    assert code == 201, body
    with cp_backend.session() as s:
        spec = runnable_spec(s, crud.get_job(s, None, body["id"]), cp_backend.settings)  # type: ignore[index]
    assert spec.model.hf_dir == str(policy_path) and spec.model.artifact_id is None
    assert spec.drafter.warm_start == str(drafter_path)


def test_worker_refuses_an_artifact_that_is_not_the_owners(rooted: TestClient, cp_backend) -> None:
    """The worker resolves ids with the job owner's rights: a stored spec naming someone else's artifact (a row
    written behind the API's back) fails the attempt instead of loading it."""
    _, policy_id, _ = _own_policy(cp_backend, rooted, cp_backend.token("alice"))
    code, body = _post(rooted, cp_backend.token("bob"))
    assert code == 201
    with cp_backend.session() as s:
        job = crud.get_job(s, None, body["id"])  # type: ignore[index]
        job.spec = {**job.spec, "model": {**job.spec["model"], "builtin": None, "artifact_id": policy_id}}
        s.commit()
        with pytest.raises(SpecRefused, match=f"artifact {policy_id} not found"):
            runnable_spec(s, crud.get_job(s, None, job.id), cp_backend.settings)


def test_dataset_path_outside_roots_reveals_nothing(cp_client: TestClient, cp_backend, tmp_path: Path) -> None:
    """Finding 2: with no roots configured (the default) every dataset path is refused, and an existing file and a
    missing one get the very same answer."""
    h = cp_backend.token()
    exists = tmp_path / "secret.jsonl"
    exists.write_text('{"question": "q", "answer": "a"}\n')
    answers = {p: _post(cp_client, h, dataset={"path": p}) for p in
               (str(exists), str(tmp_path / "missing.jsonl"), "/etc/passwd", "relative/file.jsonl")}
    assert {code for code, _ in answers.values()} == {422}
    assert len({str(body) for _, body in answers.values()}) == 1, answers  # byte-identical bodies
    assert cp_backend.queued_messages() == 0  # nothing was enqueued


def test_dataset_path_inside_a_root_is_accepted_and_checked_again_by_the_worker(rooted: TestClient, cp_backend) -> None:
    data = cp_backend.settings.home.parent / "models" / "rows.jsonl"
    data.write_text('{"question": "q", "answer": "a"}\n')
    code, body = _post(rooted, cp_backend.token(), dataset={"path": str(data)})
    assert code == 201, body
    with cp_backend.session() as s:
        job = crud.get_job(s, None, body["id"])  # type: ignore[index]
        assert runnable_spec(s, job, cp_backend.settings).dataset.path == str(data)
        # a worker whose operator allows no roots refuses the same stored spec before loading anything
        with pytest.raises(SpecRefused, match="dataset.path: path not allowed"):
            runnable_spec(s, job, cp_backend.settings.model_copy(update={"spec_roots": ""}))


def test_another_users_dataset_id_is_not_found(cp_client: TestClient, cp_backend) -> None:
    alice, bob = cp_backend.token("alice"), cp_backend.token("bob")
    r = cp_client.post("/api/v1/datasets", files={"file": ("d.jsonl", b'{"question": "q", "answer": "a"}\n')},
                       headers=auth(alice))
    assert r.status_code == 201
    code, body = _post(cp_client, bob, dataset={"dataset_id": r.json()["id"]})
    assert code == 422 and "not found" in body["detail"][0]["msg"]  # type: ignore[index]
