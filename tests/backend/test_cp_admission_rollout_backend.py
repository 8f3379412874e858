"""`rollout.backend` is checked at submit (backend/admission.py check_backend, rules in
worker/tlt/rollout_backends.py): settings the vLLM backend cannot honour (adaptive switching, the bandit, draft trees,
the n-gram drafter, idle-tail spot training, sleep mode on CPU, data parallelism) and tensor parallelism on our engine
are a 422 naming the field and saying why, nothing stored or enqueued; a runnable vLLM spec passes the rules and is
then refused only when vLLM is not installed where the API runs (this environment), and admitted when it is.

Run: python -m pytest tests/backend/test_cp_admission_rollout_backend.py -q
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import worker.tlt.rollout_backends as rb
from tests.backend.test_cp_safety_admission import SPEC, _no_job_stored, _refusal, auth
from worker.tlt.config import JobSpec

VLLM = {**SPEC, "rollout": {"backend": "vllm", "speculative": "off"}, "drafter": {"kind": "none"}}
VLLM_SD = {**SPEC, "rollout": {"backend": "vllm", "speculative": "on", "draft_depth": 3},
           "drafter": {"kind": "eagle1"}}


def _with(base: dict, **parts: dict) -> dict:
    return {**base, **{k: {**base.get(k, {}), **v} for k, v in parts.items()}}


REFUSED = [  # (spec, field, words the reason must contain)
    (_with(VLLM, rollout={"speculative": "adaptive"}), ["rollout", "speculative"], "adaptive SD switching is a "
     "feature of our engine"),
    (_with(VLLM, rollout={"bandit": "ucb"}), ["rollout", "bandit"], "rollout.bandit steers adaptive SD"),
    (_with(VLLM, rollout={"sd_switch": "step_costs"}), ["rollout", "sd_switch"], "feature of our engine"),
    (_with(VLLM, rollout={"sd_on_below": 8}), ["rollout", "sd_on_below"], "the vLLM backend would ignore it"),
    (_with(VLLM_SD, rollout={"draft_topk": 4}), ["rollout", "draft_topk"], "draft trees are a feature of our engine"),
    (_with(VLLM_SD, drafter={"kind": "ngram"}), ["drafter", "kind"], "the n-gram drafter over GRPO siblings"),
    (_with(VLLM_SD, drafter={"train_after_update": False}), ["drafter", "train_after_update"],
     "idle-tail spot training is a feature of our engine"),
    (_with(VLLM_SD, drafter={"draft_vocab_size": 1000}), ["drafter", "draft_vocab_size"],
     "reduced EAGLE-1 draft vocabulary"),
    (_with(VLLM, rollout={"release_kv_for_update": True}), ["rollout", "release_kv_for_update"],
     "sleep mode, which needs CUDA"),
    (_with(VLLM, resources={"tensor_parallel": 2}), ["resources", "tensor_parallel"], "tensor parallelism needs GPUs"),
    (_with(SPEC, resources={"tensor_parallel": 2}), ["resources", "tensor_parallel"],
     "tensor parallelism is the vLLM backend's"),
]


@pytest.mark.parametrize(("spec", "loc", "why"), REFUSED, ids=[".".join(r[1]) + f"-{i}" for i, r in
                                                                 enumerate(REFUSED)])
def test_settings_the_backend_cannot_honour_are_refused_with_the_reason(
        cp_client: TestClient, cp_backend, monkeypatch: pytest.MonkeyPatch, spec: dict, loc: list[str],
        why: str) -> None:
    monkeypatch.setattr(rb, "find_spec", lambda name: object())  # as if vLLM were installed: the rules speak first
    got_loc, msg = _refusal(cp_client, cp_backend.token(), spec)
    assert got_loc == ["body", "spec", *loc]
    backend = spec.get("rollout", {}).get("backend", "tlt")
    assert msg.startswith(f"rollout.backend {backend}: ") and why in msg, msg
    _no_job_stored(cp_backend)


def test_data_parallel_gpus_with_vllm_are_refused() -> None:
    spec = JobSpec.model_validate(_with(VLLM, resources={"gpus": 4, "tensor_parallel": 2}))
    [(loc, msg)] = rb.backend_refusals(spec)
    assert loc == ("resources", "gpus")
    assert "resources.gpus (4) must equal resources.tensor_parallel (2)" in msg
    tp = JobSpec.model_validate(_with(VLLM_SD, resources={"gpus": 2, "tensor_parallel": 2},
                                      rollout={"release_kv_for_update": True}))
    assert rb.backend_refusals(tp) == []  # TP over the job's GPUs, sleep mode on CUDA: all honoured


def test_runnable_vllm_specs_pass_the_rules_and_need_vllm_installed(
        cp_client: TestClient, cp_backend, monkeypatch: pytest.MonkeyPatch) -> None:
    token = cp_backend.token()
    for spec in (VLLM, VLLM_SD, _with(VLLM, rollout={"kv_cache_gb": 0.5, "cuda_graphs": False})):
        assert rb.backend_refusals(JobSpec.model_validate(spec)) == []
    monkeypatch.setattr(rb, "find_spec", lambda name: None)
    loc, msg = _refusal(cp_client, token, VLLM_SD)
    assert loc == ["body", "spec", "rollout", "backend"]
    assert msg == ("rollout.backend vllm: vLLM is not installed on this service (pip install 'tlt-studio[vllm]' "
                   "where the API and the workers run)")
    _no_job_stored(cp_backend)
    monkeypatch.setattr(rb, "find_spec", lambda name: object())
    for spec in (VLLM, VLLM_SD, SPEC):
        assert cp_client.post("/api/v1/jobs", json={"spec": spec}, headers=auth(token)).status_code == 201
