"""Per-user limits hold however many tokens a user mints, on SQLite and Postgres: the submit rate limit is one bucket
per user, a user's queued jobs are capped (429 naming TLT_MAX_QUEUED_JOBS_PER_USER), live tokens are capped (409
naming TLT_MAX_TOKENS_PER_USER), and a retry passes the same rate limit, cap, admission and quota as a submit.

Run: python -m pytest tests/backend/test_cp_safety_user_limits.py -q
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.testclient import TestClient

from backend.lifecycle import JobStatus as S
from backend.main import create_app
from backend.persistence import crud
from tests.specs import api_spec

SPEC = api_spec()


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@contextmanager
def client_with(cp_backend: Any, **settings: Any) -> Iterator[TestClient]:
    with TestClient(create_app(cp_backend.settings.model_copy(update=settings))) as client:
        yield client


def _submit(client: TestClient, h: dict[str, str]) -> int:
    return client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).status_code


def test_self_minted_tokens_share_one_rate_bucket_and_token_cap(cp_backend: Any) -> None:
    with client_with(cp_backend, submit_rate_per_min=1, submit_burst=3, max_tokens_per_user=5) as c:
        first = auth(cp_backend.token("mallory"))
        minted = [c.post("/api/v1/tokens", json={"user": "mallory", "name": f"t{i}"}, headers=first) for i in range(6)]
        assert [r.status_code for r in minted] == [201, 201, 201, 201, 409, 409]  # 5 live with the first one
        assert "TLT_MAX_TOKENS_PER_USER" in minted[-1].json()["detail"] and "5" in minted[-1].json()["detail"]
        tokens = [first] + [auth(r.json()["token"]) for r in minted if r.status_code == 201]
        codes = [_submit(c, h) for h in tokens for _ in range(2)]  # 10 tries over 5 tokens
        assert codes.count(201) == 3 and codes.count(429) == 7  # one burst for the user, not one per token
        assert _submit(c, auth(cp_backend.token("bob"))) == 201  # another user has a bucket of their own
        revoked = c.delete(f"/api/v1/tokens/{minted[0].json()['id']}", headers=first)
        assert revoked.status_code == 200  # revoking makes room for one more
        assert c.post("/api/v1/tokens", json={"user": "mallory"}, headers=first).status_code == 201
    with cp_backend.session() as s:
        assert crud.count_jobs_by_status(s, crud.get_or_create_user(s, "mallory")) == {"queued": 3}


def test_queued_jobs_capped_per_user(cp_backend: Any) -> None:
    with client_with(cp_backend, submit_rate_per_min=0, max_queued_jobs_per_user=4) as c:
        tokens = [auth(cp_backend.token("mallory")) for _ in range(3)]
        codes = [_submit(c, tokens[i % 3]) for i in range(7)]
        assert codes == [201] * 4 + [429] * 3
        r = c.post("/api/v1/jobs", json={"spec": SPEC}, headers=tokens[0])
        assert "TLT_MAX_QUEUED_JOBS_PER_USER" in r.json()["detail"] and "is 4" in r.json()["detail"]
        assert _submit(c, auth(cp_backend.token("bob"))) == 201  # the cap is per user
        first = c.get("/api/v1/jobs", headers=tokens[0]).json()["items"][-1]["id"]
        assert c.post(f"/api/v1/jobs/{first}/cancel", headers=tokens[0]).json()["status"] == "cancelled"
        assert _submit(c, tokens[1]) == 201  # a cancelled job frees its place
    assert cp_backend.queued_messages("cpu") == 6  # 4 + bob's + the one after the cancel; refusals enqueued nothing


def test_retry_passes_rate_limit_cap_and_quota(cp_backend: Any) -> None:
    with client_with(cp_backend, submit_rate_per_min=0, max_queued_jobs_per_user=2, user_quota_gb=1) as c:
        h = auth(cp_backend.token("mallory"))
        jid = c.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
        c.post(f"/api/v1/jobs/{jid}/cancel", headers=h)
        assert _submit(c, h) == _submit(c, h) == 201  # two queued: the cap
        r = c.post(f"/api/v1/jobs/{jid}/retry", headers=h)
        assert r.status_code == 429 and "TLT_MAX_QUEUED_JOBS_PER_USER" in r.json()["detail"]
        with cp_backend.session() as s:  # make room, then fill the quota
            for other in (jid + 1, jid + 2):
                crud.request_cancel(s, crud.get_job(s, None, other))
            crud.register_artifact(s, jid, kind="policy", path="/store/p", is_dir=True, size=2 * 1024**3,
                                   sha256="0" * 64, step=None)
            s.commit()
        r = c.post(f"/api/v1/jobs/{jid}/retry", headers=h)
        assert r.status_code == 409 and "quota" in r.json()["detail"]
        with cp_backend.session() as s:
            crud.mark_artifacts_deleted(s, [a.id for a in crud.list_artifacts(s, jid)])
            s.commit()
        assert c.post(f"/api/v1/jobs/{jid}/retry", headers=h).json()["status"] == "queued"
        with cp_backend.session() as s:
            assert crud.get_job(s, None, jid).status == S.queued
    with client_with(cp_backend, submit_rate_per_min=1, submit_burst=2) as c:
        h = auth(cp_backend.token("rita"))
        jid = c.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
        c.post(f"/api/v1/jobs/{jid}/cancel", headers=h)
        assert _submit(c, h) == 201  # the burst of 2 is spent
        r = c.post(f"/api/v1/jobs/{jid}/retry", headers=h)
        assert r.status_code == 429 and "rate limit" in r.json()["detail"] and "Retry-After" in r.headers
        with cp_backend.session() as s:
            assert crud.get_job(s, None, jid).status == S.cancelled  # the refused retry changed nothing
