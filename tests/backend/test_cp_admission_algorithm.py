"""The spec's algorithm is checked at submit against the worker library's registry: an unknown name is a 422 that
lists the registered ones (nothing stored or enqueued), a registered one and the older loss_type spelling are
admitted.

Run: python -m pytest tests/backend/test_cp_admission_algorithm.py -q
"""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.backend.test_cp_safety_admission import SPEC, _no_job_stored, _refusal, auth


def test_unknown_algorithm_is_refused_with_the_registered_names(cp_client: TestClient, cp_backend) -> None:
    token = cp_backend.token()
    loc, msg = _refusal(cp_client, token, {**SPEC, "algorithm": {"name": "ppo_typo", "max_completion_length": 8}})
    assert loc == ["body", "spec", "algorithm", "name"]
    assert msg == "unknown algorithm 'ppo_typo'; registered: dapo, dr_grpo, grpo, gspo, reinforce_plus_plus, rloo"
    _no_job_stored(cp_backend)
    for algorithm in ({"name": "gspo"}, {"loss_type": "dr_grpo"}):
        spec = {**SPEC, "algorithm": {**algorithm, "max_completion_length": 8}}
        assert cp_client.post("/api/v1/jobs", json={"spec": spec}, headers=auth(token)).status_code == 201
