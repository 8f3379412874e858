"""Schemathesis over the API's own OpenAPI document, every operation: with an admin token no response is a server
error and every response conforms to the document (status code, content type, headers, body schema); without a
token every route but /healthz answers 401; NaN, Infinity and lone surrogates in bodies and queries are a 4xx.
Bounded (a few examples per operation) so it runs in well under a minute.

Run: python -m pytest tests/hardening/test_hard_schemathesis.py -q
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis.errors import Unsatisfiable
from requests.structures import CaseInsensitiveDict
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from backend.core import migrate
from backend.core.config import Settings
from backend.lifecycle import JobStatus
from backend.main import create_app
from backend.persistence import crud
from tests.specs import api_spec

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 8}  # generated cases per operation and mode


def _seed(app: FastAPI, home: Path) -> str:
    """An admin, a finished job with telemetry and a file artifact, so fuzzed ids 1.. hit real rows too."""
    with app.state.session_factory() as s:
        tok, secret = crud.create_token(s, "root", admin=True)
        assert tok.id == 1
        owner = crud.get_or_create_user(s, "root")
        from worker.tlt.config import JobSpec

        job, _ = crud.create_job(s, owner, JobSpec(), None)
        crud.transition(s, job.id, JobStatus.cancelled, reason="seed")
        crud.upsert_metrics(s, job.id, [(0, "loss", 1.0), (1, "loss", float("nan"))])
        crud.upsert_histogram(s, job.id, 0, "response_length", [0.0, 1.0, 2.0], [3, 4])
        crud.add_logs(s, job.id, 0, ["hello"])
        crud.add_samples(s, job.id, 0, [{"prompt": "p", "response": "r", "reward": 1.0}])
        art = home / "artifacts" / "runs" / "1" / "policy.bin"
        art.parent.mkdir(parents=True, exist_ok=True)
        art.write_bytes(b"x" * 100)
        crud.register_artifact(s, job.id, kind="policy", path=str(art), is_dir=False, size=100,
                               sha256=hashlib.sha256(art.read_bytes()).hexdigest(), step=None)
        s.commit()
    return secret


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def fuzz_app(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, hard_settings: Callable[..., Settings]
) -> Iterator[tuple[FastAPI, str]]:
    home = tmp_path_factory.mktemp("fuzz")
    overrides: dict[str, object] = {}
    if request.param == "postgres":  # NUL bytes, bigint bounds, ... differ from SQLite
        url = request.getfixturevalue("pg_database")()  # tests/conftest.py: a fresh empty database
        migrate.upgrade(url)
        overrides["database_url"] = url
    app = create_app(hard_settings(home, **overrides))
    with TestClient(app):  # runs the lifespan (schema check, artifact dir)
        yield app, _seed(app, home)


def _fuzz_operation(operation: APIOperation, mode: GenerationMode, token: str, seen: dict[int, int]) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        assume(case.path_parameters != {"token_id": 1})  # revoking the fuzzer's own token would 401 all the rest
        # ours, replacing any generated one; a negative case that dropped the header becomes a valid one (no-auth is
        # tested by test_every_route_but_healthz_needs_a_token)
        case.headers = CaseInsensitiveDict({**dict(case.headers or {}), "Authorization": f"Bearer {token}"})
        response = case.call_and_validate(checks=CHECKS)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_fuzz_admin_conforms(fuzz_app: tuple[FastAPI, str], mode: GenerationMode) -> None:
    """Every operation of the document, with valid (positive) and invalid (negative) inputs (schemathesis's pytest
    plugin does not load under pytest 9, so the operations are walked here, each a bounded hypothesis test); all
    failures are listed together."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app[0])
    failures, count, no_inputs = [], 0, []
    seen: dict[int, int] = {}  # status code -> responses
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # the document loads without schema errors
        operation = result.ok()
        count += 1
        try:
            _fuzz_operation(operation, mode, fuzz_app[1], seen)
        except (AssertionError, BaseExceptionGroup) as e:  # schemathesis's Failure / FailureGroup, listed together
            failures.append(f"{operation.label}: {e}")
        except Unsatisfiable:  # negative mode: nothing of this operation can be made invalid
            no_inputs.append(operation.label)
    doc = TestClient(fuzz_app[0]).get("/openapi.json").json()
    for label in no_inputs:  # only operations without parameters or body, e.g. GET /healthz
        method, path = label.split(" ", 1)
        op = doc["paths"][path][method.lower()]
        assert mode == GenerationMode.NEGATIVE and not op.get("parameters") and "requestBody" not in op, label
    assert count >= 20
    if mode == GenerationMode.POSITIVE:  # the token worked and valid input was accepted: many 2xx
        assert seen.get(200, 0) + seen.get(201, 0) >= count, sorted(seen.items())
    else:  # invalid input was refused
        assert seen.get(422, 0) + seen.get(400, 0) >= count, sorted(seen.items())
    assert 401 not in seen, seen
    assert not failures, "\n\n".join(failures)


NAN_AND_SURROGATES = (float("nan"), float("inf"), "\ud800", "x\udfff")


def _poison(value: object, bad: object) -> object:
    """`value` with every number (bad is a float) or every string (bad is a str) replaced by `bad`."""
    if isinstance(value, dict):
        return {k: _poison(v, bad) for k, v in value.items()}
    if isinstance(value, list):
        return [_poison(v, bad) for v in value]
    if isinstance(bad, float) and isinstance(value, int | float) and not isinstance(value, bool):
        return bad
    if isinstance(bad, str) and isinstance(value, str):
        return bad
    return value


def _send_poisoned(operation: APIOperation, client: TestClient, token: str, seen: dict[int, int]) -> None:
    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    @settings(max_examples=3, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        assume(case.path_parameters != {"token_id": 1})
        headers = {"Authorization": f"Bearer {token}"}
        for bad in NAN_AND_SURROGATES:
            # in a query: the literal NaN / Infinity, or a surrogate's (invalid) UTF-8 bytes, percent-encoded
            word = {"nan": "NaN", "inf": "Infinity"}.get(str(bad), "%ED%A0%80")
            query = "&".join(f"{k}={word}" for k, v in (case.query or {}).items() if isinstance(v, int | float | str))
            kwargs: dict[str, object] = {}
            if case.media_type == "application/json" and isinstance(case.body, dict | list):
                # json.dumps writes NaN / Infinity literals and \ud800 escapes: what a hostile client can send
                kwargs["content"] = json.dumps(_poison(case.body, bad)).encode()
                headers["Content-Type"] = "application/json"
            elif not query:
                continue
            url = case.formatted_path + (f"?{query}" if query else "")
            r = client.request(case.method, url, headers=headers, **kwargs)  # type: ignore[arg-type]
            assert r.status_code < 500, (case.method, case.formatted_path, bad, r.status_code, r.text)
            if r.headers.get("content-type", "").startswith("application/json"):
                r.json()  # whatever was echoed is valid JSON
            seen[r.status_code] = seen.get(r.status_code, 0) + 1

    run()


def test_fuzz_nan_infinity_and_lone_surrogates(fuzz_app: tuple[FastAPI, str]) -> None:
    """Valid generated inputs with every number made NaN or Infinity and every string a lone surrogate, in JSON
    bodies and query strings, for every operation: never a server error, and JSON bodies are refused (422)."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app[0])
    client = TestClient(fuzz_app[0], raise_server_exceptions=False)
    seen: dict[int, int] = {}
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        try:
            _send_poisoned(operation, client, fuzz_app[1], seen)
        except (AssertionError, BaseExceptionGroup) as e:
            failures.append(f"{operation.label}: {e}")
        except Unsatisfiable:
            pass
    assert not failures, "\n\n".join(failures)
    assert seen.get(422, 0) >= 20, sorted(seen.items())
    assert 401 not in seen, seen


def test_every_route_but_healthz_needs_a_token(fuzz_app: tuple[FastAPI, str]) -> None:
    app = fuzz_app[0]
    client = TestClient(app)
    doc = client.get("/openapi.json").json()
    seen = 0
    for path, ops in doc["paths"].items():
        url = re.sub(r"\{[^}]+\}", "1", path)
        for method in ops:
            for headers in ({}, {"Authorization": "Bearer tlt_not_a_real_token"}, {"Authorization": "Basic eDp5"}):
                r = client.request(method.upper(), url, headers=headers)
                want = 200 if path == "/healthz" else 401
                assert r.status_code == want, (method, path, headers, r.status_code, r.text)
                if want == 401:
                    assert r.headers.get("www-authenticate") == "Bearer"
            seen += 1
    assert seen >= 20  # the document really lists the API


def test_nul_bytes_are_client_errors(fuzz_app: tuple[FastAPI, str]) -> None:
    """Postgres text cannot hold NUL: inputs with one are a 4xx on both databases, never a 500."""
    client = TestClient(fuzz_app[0], raise_server_exceptions=False)
    h = {"Authorization": f"Bearer {fuzz_app[1]}"}
    spec = api_spec()
    for url in ("/api/v1/datasets/%00", "/api/v1/jobs?owner=%00", "/api/v1/jobs?cursor=%00",
                "/api/v1/jobs/1/histograms?name=%00", "/api/v1/jobs/1/metrics?names=a%00",
                "/api/v1/jobs/1/stream?last_event_id=%00"):
        r = client.get(url, headers=h)
        assert r.status_code in (200, 400, 404), (url, r.status_code, r.text)  # SQLite stores NUL: 200/404 there
    for r in (client.post("/api/v1/tokens", json={"user": "a", "name": "x\x00"}, headers=h),
              client.post("/api/v1/jobs", json={"spec": {**spec, "name": "a\x00b"}}, headers=h),
              client.post("/api/v1/datasets", files={"file": ("a.jsonl", b'{"question": "q\\u0000", "answer": "a"}\n')},
                          headers=h)):
        assert r.status_code in (200, 201, 400, 429), (r.request.url, r.status_code, r.text)
