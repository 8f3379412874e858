"""Admission sizes what a job will allocate, on SQLite and Postgres: `drafter.buffer_gb: 4096` (the worker tried to
allocate 4 TB), `prompts_per_step: 65536` (worker memory past 6 GB in 31 s) and a 100,000-character system prompt
(no prompt fits max_prompt_length) were admitted; now each is a 422 naming the field and the numbers, and nothing is
stored or enqueued. Specs that fit are still admitted, the presets among them.

Run: python -m pytest tests/backend/test_cp_safety_sizes.py -q
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete

from backend.persistence import crud
from backend.persistence.models import Job, Worker
from tests.specs import api_spec
from worker.tlt.config import PRESETS

SPEC: dict[str, Any] = api_spec()
CPU_16 = crud.Capacity(queues=["cpu"], gpus=0, host_memory_gb=16.0)
GPU_24 = crud.Capacity(queues=["gpu"], gpus=1, gpu_memory_gb=24.0, host_memory_gb=64.0, cuda="12.8")


@pytest.fixture
def workers(cp_backend: Any) -> None:
    with cp_backend.session() as s:
        s.execute(delete(Worker))
        s.commit()
        crud.register_worker(s, "cpu@host", CPU_16)
        crud.register_worker(s, "gpu@host", GPU_24)


def _submit(client: TestClient, cp_backend: Any, **over: Any):  # type: ignore[no-untyped-def]
    spec = {**SPEC, **over}
    return client.post("/api/v1/jobs", json={"spec": spec}, headers={"Authorization": f"Bearer {cp_backend.token()}"})


def _refused(r, loc: list[str]) -> str:  # type: ignore[no-untyped-def]
    assert r.status_code == 422, r.text
    err = r.json()["detail"][0]
    assert err["loc"] == ["body", "spec", *loc], err
    return str(err["msg"])


@pytest.mark.usefixtures("workers")
def test_drafter_buffer_beyond_worker_memory(cp_client: TestClient, cp_backend: Any) -> None:
    msg = _refused(_submit(cp_client, cp_backend, drafter={"buffer_gb": 4096}, resources={"gpus": 1}),
                   ["drafter", "buffer_gb"])
    assert "4096 GB exceeds the GPU memory" in msg and "at most 24.0 GB" in msg
    both = _submit(cp_client, cp_backend, drafter={"buffer_gb": 20}, rollout={"kv_cache_gb": 8}, resources={"gpus": 1})
    assert "= 28 GB exceeds" in _refused(both, ["drafter", "buffer_gb"])  # the two share the GPU
    cpu = _submit(cp_client, cp_backend, drafter={"buffer_gb": 10})  # + the CPU KV cache default of 8 GB > 16 GB
    assert "at most 16.0 GB" in _refused(cpu, ["drafter", "buffer_gb"])
    assert _submit(cp_client, cp_backend, drafter={"buffer_gb": 10, "kind": "ngram"}).status_code == 201  # no buffer
    assert _submit(cp_client, cp_backend, drafter={"buffer_gb": 20}, resources={"gpus": 1}).status_code == 201
    with cp_backend.session() as s:
        assert s.query(Job).count() == 2  # only the admitted ones


@pytest.mark.usefixtures("workers")
def test_rollout_batch_beyond_host_memory(cp_client: TestClient, cp_backend: Any) -> None:
    big = {"prompts_per_step": 65536, "max_completion_length": 8}
    msg = _refused(_submit(cp_client, cp_backend, algorithm=big), ["algorithm", "prompts_per_step"])
    assert "host memory" in msg and "at most 16.0 GB" in msg
    assert _submit(cp_client, cp_backend, algorithm={**big, "prompts_per_step": 256}).status_code == 201
    assert cp_backend.queued_messages("cpu") == 1


@pytest.mark.usefixtures("workers")
def test_system_prompt_that_leaves_no_room_for_a_prompt(cp_client: TestClient, cp_backend: Any) -> None:
    long = "x" * 100_000
    msg = _refused(_submit(cp_client, cp_backend, dataset={"builtin": "toy-count", "system_prompt": long}),
                   ["dataset", "system_prompt"])
    assert msg.startswith("the system prompt alone is at least 100000 tokens, more than max_prompt_length (512)")
    smol = {"builtin": "smollm2-135m-instruct"}  # 81 bytes per token at most: 100,000 bytes are >= 1235 tokens
    r = _submit(cp_client, cp_backend, model=smol, dataset={"builtin": "toy-count", "system_prompt": long})
    assert "at least 1235 tokens" in _refused(r, ["dataset", "system_prompt"])
    fits = {"builtin": "toy-count", "system_prompt": "x" * 2000, "max_prompt_length": 512}
    assert _submit(cp_client, cp_backend, model=smol, dataset=fits).status_code == 201


def test_presets_are_admitted(cp_client: TestClient, cp_backend: Any) -> None:
    h = {"Authorization": f"Bearer {cp_backend.token()}"}
    for name, spec in PRESETS.items():
        r = cp_client.post("/api/v1/jobs", json={"spec": spec}, headers=h)
        assert r.status_code == 201, (name, r.text)
