"""Specs no worker could run are a 422 at submit, with the reason (findings 3 and 6 of the service-safety review), on
SQLite and Postgres: a queue no live worker consumes, more GPUs or KV memory than any worker has, numbers beyond
their bounds, lengths beyond the model's context, EAGLE-3 on a model too shallow for it. Nothing is stored or
enqueued for a refused spec.

Run: python -m pytest tests/backend/test_cp_safety_admission.py -q
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, update

from backend.persistence import crud
from backend.persistence.models import Job, Worker, utcnow
from tests.specs import api_spec
from worker.tlt.builtin_models import BUILTIN_MODELS, WIDENED
from worker.tlt.config import BUILTIN_MODELS as SCHEMA_MODEL_NAMES
from worker.tlt.config import CPU_KV_CACHE_GB, JobSpec

SPEC = api_spec(name="t")
CPU_ONLY = crud.Capacity(queues=["cpu"], gpus=0, host_memory_gb=16.0)
ONE_GPU = crud.Capacity(queues=["gpu"], gpus=1, gpu_memory_gb=24.0, host_memory_gb=64.0, cuda="12.8")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _workers(cp_backend, *caps: crud.Capacity) -> None:
    """Replace the test worker with these (named w0, w1, ...)."""
    with cp_backend.session() as s:
        s.execute(delete(Worker))
        s.commit()
        for i, cap in enumerate(caps):
            crud.register_worker(s, f"w{i}@host", cap)


def _refusal(client: TestClient, token: str, spec: dict) -> tuple[list[str], str]:
    r = client.post("/api/v1/jobs", json={"spec": spec}, headers=auth(token))
    assert r.status_code == 422, r.text
    err = r.json()["detail"][0]
    return err["loc"], err["msg"]


def _no_job_stored(cp_backend) -> None:
    with cp_backend.session() as s:
        assert s.query(Job).count() == 0
    assert cp_backend.queued_messages("cpu") == cp_backend.queued_messages("gpu") == 0


def test_queue_nobody_listens_to_is_refused(cp_client: TestClient, cp_backend) -> None:
    """Finding 3: `resources.queue: nobody-listens` was a 201 and a job queued forever."""
    _workers(cp_backend, CPU_ONLY, ONE_GPU)
    loc, msg = _refusal(cp_client, cp_backend.token(), {**SPEC, "resources": {"queue": "nobody-listens"}})
    assert loc == ["body", "spec", "resources", "queue"]
    assert msg == "no live worker consumes queue 'nobody-listens' (known: cpu, gpu)"
    _no_job_stored(cp_backend)
    ok = cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=auth(cp_backend.token()))
    assert ok.status_code == 201 and ok.json()["queue"] == "cpu"


def test_no_live_worker_is_refused(cp_client: TestClient, cp_backend) -> None:
    """A worker whose beat is older than worker_ttl_s no longer counts; with none left every job is refused."""
    _workers(cp_backend, CPU_ONLY)
    with cp_backend.session() as s:
        s.execute(update(Worker).values(heartbeat_at=utcnow() - timedelta(seconds=cp_backend.settings.worker_ttl_s + 5)))
        s.commit()
    loc, msg = _refusal(cp_client, cp_backend.token(), SPEC)
    assert msg.startswith("no worker is running")
    with cp_backend.session() as s:  # its heartbeat brings it back
        crud.beat_worker(s, "w0@host", CPU_ONLY)
    assert cp_client.post("/api/v1/jobs", json={"spec": SPEC}, headers=auth(cp_backend.token())).status_code == 201


def test_gpus_and_kv_memory_beyond_every_worker_are_refused(cp_client: TestClient, cp_backend) -> None:
    """Finding 6: a GPU job with only CPU workers, more GPUs than any worker has, a KV cache larger than the GPU's
    (GPU job) or the host's (CPU job) memory."""
    token = cp_backend.token()
    _workers(cp_backend, CPU_ONLY)
    loc, msg = _refusal(cp_client, token, {**SPEC, "resources": {"gpus": 1}})
    assert loc == ["body", "spec", "resources", "queue"] and "'gpu'" in msg
    loc, msg = _refusal(cp_client, token, {**SPEC, "resources": {"gpus": 1, "queue": "cpu"}})
    assert loc == ["body", "spec", "resources", "gpus"] and "at most 0" in msg
    loc, msg = _refusal(cp_client, token, {**SPEC, "rollout": {"kv_cache_gb": 17}})
    assert loc == ["body", "spec", "rollout", "kv_cache_gb"] and "host memory" in msg
    _workers(cp_backend, CPU_ONLY, ONE_GPU)
    loc, msg = _refusal(cp_client, token, {**SPEC, "resources": {"gpus": 2}})
    assert "asks for 2 GPU(s)" in msg and "at most 1" in msg
    loc, msg = _refusal(cp_client, token, {**SPEC, "resources": {"gpus": 1}, "rollout": {"kv_cache_gb": 30}})
    assert loc == ["body", "spec", "rollout", "kv_cache_gb"] and "GPU memory" in msg and "24.0 GB" in msg
    _no_job_stored(cp_backend)
    r = cp_client.post("/api/v1/jobs", json={"spec": {**SPEC, "resources": {"gpus": 1}, "rollout": {"kv_cache_gb": 20}}},
                       headers=auth(token))
    assert r.status_code == 201 and r.json()["queue"] == "gpu"



def test_unset_kv_budget_is_checked_as_the_cpu_default_on_cpu_only(cp_client: TestClient, cp_backend) -> None:
    """An unset kv_cache_gb is CPU_KV_CACHE_GB on a CPU job (within the host's memory) and planned from free memory
    on a GPU job (nothing to check at submit)."""
    token = cp_backend.token()
    small_host = crud.Capacity(queues=["cpu"], gpus=0, host_memory_gb=CPU_KV_CACHE_GB / 2)
    small_gpu = crud.Capacity(queues=["gpu"], gpus=1, gpu_memory_gb=CPU_KV_CACHE_GB / 2, host_memory_gb=64.0)
    _workers(cp_backend, small_host, small_gpu)
    loc, msg = _refusal(cp_client, token, SPEC)
    assert loc == ["body", "spec", "rollout", "kv_cache_gb"] and f"kv_cache_gb {CPU_KV_CACHE_GB:g} " in msg
    _no_job_stored(cp_backend)
    r = cp_client.post("/api/v1/jobs", json={"spec": {**SPEC, "resources": {"gpus": 1}}}, headers=auth(token))
    assert r.status_code == 201 and r.json()["queue"] == "gpu"

@pytest.mark.parametrize(("path", "value"), [
    (("seed",), 2**200), (("seed",), -1), (("rollout", "seed"), 2**63), (("algorithm", "max_completion_length"), 10**9),
    (("rollout", "kv_cache_gb"), 1e6), (("dataset", "max_prompt_length"), 10**9), (("algorithm", "top_k"), 10**12),
    (("drafter", "buffer_gb"), 1e9), (("save_total_limit",), 10**6), (("algorithm", "num_generations"), 10**6),
])
def test_numbers_beyond_their_bounds_are_refused(cp_client: TestClient, cp_backend, path: tuple[str, ...],
                                                 value: float) -> None:
    """Finding 6: `seed: 2**200`, `max_completion_length: 10**9`, `kv_cache_gb: 1e6` were accepted."""
    spec = copy.deepcopy(SPEC)
    node: dict = spec
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    loc, _ = _refusal(cp_client, cp_backend.token(), spec)
    assert tuple(loc[2:]) == path
    _no_job_stored(cp_backend)


def test_lengths_beyond_the_models_context_and_eagle3_on_a_shallow_model(cp_client: TestClient, cp_backend) -> None:
    token = cp_backend.token()
    loc, msg = _refusal(cp_client, token, {**SPEC, "algorithm": {"max_completion_length": 1000},
                                           "dataset": {"builtin": "toy-count", "max_prompt_length": 64}})
    assert msg == ("max_prompt_length + max_completion_length = 1064 tokens exceeds the context of tiny-llama "
                   "(1024 tokens)")
    loc, msg = _refusal(cp_client, token, {**SPEC, "drafter": {"kind": "eagle3"}})
    assert loc == ["body", "spec", "drafter", "kind"] and "tiny-llama has 2" in msg
    ok = {**SPEC, "model": {"builtin": "smollm2-135m-instruct"}, "drafter": {"kind": "eagle3"}}
    assert cp_client.post("/api/v1/jobs", json={"spec": ok}, headers=auth(token)).status_code == 201


def test_builtin_shapes_match_the_engine() -> None:
    """The control plane's torch-free table of built-in models (worker/tlt/builtin_models.py) names every model the
    schema accepts, with the engine's context, depth, width and vocabulary (presets, and widened models as built)."""
    from worker.tlt.model.args import PRESETS
    from worker.tlt.model.widen import WIDENED_BUILTINS, parse_name, plan

    assert set(BUILTIN_MODELS) == set(SCHEMA_MODEL_NAMES) and set(WIDENED) == set(WIDENED_BUILTINS)
    engine_name = {"smollm2-135m-instruct": "smollm2-135m"}
    for name, shape in BUILTIN_MODELS.items():
        args = plan(parse_name(name)).args if name in WIDENED else PRESETS[engine_name.get(name, name)]
        assert (args.max_seq_len, args.n_layers, args.dim, args.vocab_size) == (
            shape.context, shape.layers, shape.hidden, shape.vocab), name


@pytest.mark.parametrize("name", sorted(SCHEMA_MODEL_NAMES))
def test_every_builtin_model_name_is_admitted_or_refused_with_a_reason(cp_client: TestClient, cp_backend,
                                                                     name: str) -> None:
    """`smollm2-135m-instruct@qwen2.5-7b` (and @test, @llama3-8b) were a 500: admission knew no shape for them."""
    h = auth(cp_backend.token())
    spec = {**SPEC, "model": {"builtin": name}}
    assert JobSpec.model_validate(spec).model.builtin == name
    r = cp_client.post("/api/v1/jobs", json={"spec": spec}, headers=h)
    assert r.status_code == 201, r.text
    too_long = {**spec, "algorithm": {"max_completion_length": BUILTIN_MODELS[name].context},
                "dataset": {"builtin": "toy-count", "max_prompt_length": 8}}
    loc, msg = _refusal(cp_client, cp_backend.token(), too_long)
    assert f"exceeds the context of {name} ({BUILTIN_MODELS[name].context} tokens)" in msg
