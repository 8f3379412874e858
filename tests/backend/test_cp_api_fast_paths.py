"""The request path's fast paths keep their rules: statements built once (per filter combination) never carry one
request's user into another's; the token check reads revoked_at on every request (no cache) and throttles its
last_used_at write; JSON columns read with orjson still read what Python's json wrote (NaN, Infinity, big ints);
SQLite connections run WAL with synchronous=NORMAL."""

from __future__ import annotations

import json
import math

from fastapi.testclient import TestClient
from sqlalchemy import select, text

from backend.api.deps import get_current_user
from backend.persistence import crud
from backend.persistence.db import json_loads, make_engine
from backend.persistence.models import ApiToken
from tests.specs import api_spec

SPEC = api_spec(name="fast")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_list_and_get_never_mix_users(cp_client: TestClient, cp_backend) -> None:
    alice, bob, admin = (auth(cp_backend.token(u, admin=(u == "root"))) for u in ("alice", "bob", "root"))
    mine = {name: [cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=h).json()["id"] for _ in range(2)]
            for name, h in (("alice", alice), ("bob", bob))}
    for _ in range(2):  # interleaved: the cached statement of one user must not answer for the other
        for name, h in (("alice", alice), ("bob", bob)):
            items = cp_client.get("/api/v1/jobs", headers=h).json()["items"]
            assert [j["id"] for j in items] == mine[name][::-1] and {j["owner"] for j in items} == {name}
            other = mine["bob" if name == "alice" else "alice"][0]
            assert cp_client.get(f"/api/v1/jobs/{other}", headers=h).status_code == 404
            assert cp_client.get(f"/api/v1/jobs/{other}/events", headers=h).status_code == 404
            assert cp_client.get(f"/api/v1/jobs/{mine[name][0]}/events", headers=h).status_code == 200
    everyone = cp_client.get("/api/v1/jobs", headers=admin).json()["items"]
    assert sorted(j["id"] for j in everyone) == sorted(mine["alice"] + mine["bob"])
    page = cp_client.get("/api/v1/jobs", params={"owner": "bob", "limit": 1}, headers=admin).json()
    assert [j["id"] for j in page["items"]] == [mine["bob"][1]] and page["next_cursor"]
    rest = cp_client.get("/api/v1/jobs", params={"owner": "bob", "cursor": page["next_cursor"]}, headers=admin).json()
    assert [j["id"] for j in rest["items"]] == [mine["bob"][0]] and rest["next_cursor"] is None
    one = cp_client.get(f"/api/v1/jobs/{mine['alice'][0]}", headers=alice).json()
    assert (one["owner"], one["status"], one["spec"]["name"], one["last_step"]) == ("alice", "queued", "fast", None)


def test_revocation_is_seen_by_the_next_request(cp_client: TestClient, cp_backend) -> None:
    token = cp_backend.token("carol")
    assert cp_client.get("/api/v1/jobs", headers=auth(token)).status_code == 200  # a live token, just used
    with cp_backend.session() as s:  # revoked behind the API's back (another process: `tlt token revoke`)
        tid = s.scalar(select(ApiToken.id).join(ApiToken.user).where(ApiToken.prefix == token[:12]))
        crud.revoke_token(s, tid)
    r = cp_client.get("/api/v1/jobs", headers=auth(token))
    assert r.status_code == 401 and r.json()["detail"] == "invalid or revoked token"


def test_last_used_at_is_written_at_most_once_a_minute(cp_client: TestClient, cp_backend) -> None:
    token = cp_backend.token("dave")

    def last_used():  # type: ignore[no-untyped-def]
        with cp_backend.session() as s:
            return s.scalar(select(ApiToken.last_used_at).where(ApiToken.prefix == token[:12]))

    assert last_used() is None
    cp_client.get("/api/v1/jobs", headers=auth(token))
    first = last_used()
    assert first is not None
    cp_client.get("/api/v1/jobs", headers=auth(token))
    assert last_used() == first  # throttled
    with cp_backend.session() as s:  # an hour ago: the next request writes it again
        s.execute(text("UPDATE api_tokens SET last_used_at = :t WHERE prefix = :p"),
                  {"t": first.replace(year=first.year - 1), "p": token[:12]})
        s.commit()
    cp_client.get("/api/v1/jobs", headers=auth(token))
    assert last_used() >= first


def test_json_loads_reads_what_json_wrote() -> None:
    docs = ({"a": [1, 2.5, None, True], "s": "é\u2028\ud800"}, [10**30, -(10**25), 2**63 - 1], [float("inf")])
    for doc in docs:
        raw = json.dumps(doc)  # Infinity and big ints are beyond orjson: the fallback reads them
        assert json_loads(raw) == json.loads(raw)
    nan = json_loads(json.dumps([float("nan")]))
    assert math.isnan(nan[0])


def test_sqlite_runs_wal_with_synchronous_normal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
    engine.dispose()


def test_token_check_gives_its_connection_back(cp_backend) -> None:
    """A request must not hold a pooled connection while it queues for its endpoint's worker thread (at load, every
    thread would wait for a connection held by requests that wait for a thread)."""
    token = cp_backend.token("erin")
    with cp_backend.session() as s:
        user = get_current_user(s, token)
        assert user.name == "erin" and not s.in_transaction()
        assert cp_backend.engine.pool.checkedout() == 0
