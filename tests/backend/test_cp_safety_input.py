"""Input JSON cannot carry (finding 5 of the service-safety review) is a 422, never a 500, on SQLite and Postgres:
NaN / Infinity in any number of a spec, a lone surrogate in any string of a spec or a token request, and a dataset
upload whose line nests 100,000 arrays deep (or just past the 64-level bound).

Run: python -m pytest tests/backend/test_cp_safety_input.py -q
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from backend.dataset_store import MAX_DEPTH
from tests.specs import api_spec

SPEC = api_spec(name="t")


def headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}


def _spec_body(fragment: str) -> bytes:
    """A JobCreate body with `fragment` (raw JSON text, e.g. `"seed": NaN`) added to the spec."""
    base = json.dumps({"spec": SPEC})
    return (base[:-2] + ", " + fragment + "}}").encode()


@pytest.mark.parametrize("fragment", [
    '"seed": NaN', '"max_steps": Infinity', '"rollout": {"kv_cache_gb": -Infinity}',
    '"algorithm": {"max_completion_length": 8, "learning_rate": NaN}',
    '"algorithm": {"max_completion_length": 8, "reward_weights": [NaN]}',
    '"name": "\\ud800"', '"dataset": {"builtin": "toy-count", "system_prompt": "x\\udfff"}',
    '"algorithm": {"max_completion_length": 8, "reward_funcs": ["\\ud83d"]}',
    '"name": NaN', '"model": {"hf_dir": "\\udc00"}',
])
def test_nan_infinity_and_lone_surrogates_in_a_spec_are_422(cp_backend, fragment: str) -> None:
    from backend.main import create_app

    with TestClient(create_app(cp_backend.settings), raise_server_exceptions=False) as client:
        r = client.post("/api/v1/jobs", content=_spec_body(fragment), headers=headers(cp_backend.token()))
        assert r.status_code == 422, (fragment, r.status_code, r.text)
        r.json()  # the echoed input is valid JSON
        assert cp_backend.queued_messages() == 0


def test_lone_surrogates_in_a_token_request_are_422(cp_client: TestClient, cp_backend) -> None:
    admin = cp_backend.token("root", admin=True)
    for body in (b'{"user": "a", "name": "\\ud800"}', b'{"user": "\\udfffx"}', b'{"user": NaN}'):
        r = cp_client.post("/api/v1/tokens", content=body, headers=headers(admin))
        assert r.status_code == 422, (body, r.text)


def test_upload_nested_100000_deep_is_422(cp_client: TestClient, cp_backend) -> None:
    """Finding 5: one line of 100,000 nested arrays made the upload a 500 (RecursionError)."""
    h = {"Authorization": f"Bearer {cp_backend.token()}"}
    good = b'{"question": "q", "answer": "a"}\n'
    deep = b'{"question": "q", "answer": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    r = cp_client.post("/api/v1/datasets", files={"file": ("d.jsonl", good + deep)}, headers=h)
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["errors"] == [f"row 2: nested deeper than {MAX_DEPTH} levels"]
    just_past = b'{"question": "q", "answer": "a", "x": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}\n"
    r = cp_client.post("/api/v1/datasets", files={"file": ("d.jsonl", just_past)}, headers=h)
    assert r.status_code == 422 and r.json()["detail"]["bad_rows"] == [1]
    at_bound = b'{"question": "q", "answer": "a", "x": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}\n"
    assert cp_client.post("/api/v1/datasets", files={"file": ("d.jsonl", at_bound)}, headers=h).status_code == 201
