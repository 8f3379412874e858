"""ReleasingRoute's one worker-thread call per request: the token check and the endpoint share one pooled connection
(one checkout, given back before the response), and refusals keep their order: no or bad token 401 before a bad
parameter's 422, and a good token with a bad parameter still 422.

Run: python -m pytest tests/backend/test_cp_api_one_hop.py -q
"""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import event

SPEC = {"model": {"builtin": "tiny-llama"}, "algorithm": {"max_completion_length": 8}, "dataset": {"builtin": "toy-count"}, "name": "hop"}


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_one_connection_checkout_per_request(cp_client: TestClient, cp_backend) -> None:  # type: ignore[no-untyped-def]
    h = auth(cp_backend.token("olga"))
    job = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"]
    engine = cp_client.app.state.session_factory.kw["bind"]  # type: ignore[attr-defined]
    checkouts: list[int] = []
    event.listen(engine, "checkout", lambda *_a: checkouts.append(1))
    # a cancel commits its write, then reads the job back: a second checkout of its own
    for method, url, n in (("GET", f"/api/v1/jobs/{job}", 1), ("GET", "/api/v1/jobs", 1),
                           ("GET", f"/api/v1/jobs/{job}/events", 1), ("GET", "/api/v1/users/me", 1),
                           ("POST", f"/api/v1/jobs/{job}/cancel", 2)):
        checkouts.clear()
        r = cp_client.request(method, url, headers=h)
        assert r.status_code == 200, (url, r.text)
        assert len(checkouts) == n, url  # the token check used the endpoint's connection
        assert engine.pool.checkedout() == 0, url  # and it is back in the pool
    checkouts.clear()
    assert cp_client.get(f"/api/v1/jobs/{job + 1000}", headers=h).status_code == 404  # an endpoint's error too
    assert len(checkouts) == 1 and engine.pool.checkedout() == 0


def test_a_bad_token_is_401_before_a_bad_parameter_is_422(cp_client: TestClient, cp_backend) -> None:  # type: ignore[no-untyped-def]
    good, bad = auth(cp_backend.token("pia")), auth("tlt_not_a_token")
    for headers, code in ((bad, 401), ({}, 401), (good, 422)):
        assert cp_client.get("/api/v1/jobs/0", headers=headers).status_code == code  # job ids start at 1
        assert cp_client.get("/api/v1/jobs", params={"limit": 0}, headers=headers).status_code == code
        assert cp_client.post("/api/v1/jobs", json={"spec": {"x": 1}}, headers=headers).status_code == code
    r = cp_client.get("/api/v1/jobs/0", headers=bad)
    assert r.json()["detail"] == "invalid or revoked token" and r.headers["WWW-Authenticate"] == "Bearer"
