"""The vLLM rollout backend's CUDA-only parts (marker gpu; not run on CPU): sleep mode around the update
(`rollout.release_kv_for_update`) and tensor parallelism (`resources.tensor_parallel`). Needs vLLM's CUDA build in
the environment that runs it (pip install 'tlt-studio[vllm]') and, for TP, two GPUs.

    python -m pytest tests/vllm/test_vllm_rollout_gpu.py -m gpu -q -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SPEC = {
    "name": "vllm-rollout-gpu",
    "model": {"builtin": "smollm2-135m-instruct", "dtype": "float32"},
    "dataset": {"builtin": "toy-count", "validation_size": 0, "system_prompt": None, "max_prompt_length": 64},
    "algorithm": {"num_generations": 4, "prompts_per_step": 2, "max_completion_length": 16, "learning_rate": 1e-3,
                  "loss_type": "grpo", "reward_funcs": ["toy_many", "brevity"], "reward_weights": [0.5, 0.5]},
    "rollout": {"backend": "vllm", "speculative": "off", "kv_cache_gb": 1.0},
    "drafter": {"kind": "none"},
    "max_steps": 1,
}


def _greedy_matches_trainer_after_a_step(spec: dict) -> tuple[dict, object]:
    from tests.vllm.vllm_rollout_check import Quiet, trainer_greedy
    from worker.tlt.build import build_trainer
    from worker.tlt.config import JobSpec

    trainer, _ = build_trainer(JobSpec.model_validate(spec), Quiet())
    metrics, _, _ = trainer.step()
    prompts = [trainer.sampler.rows[0]]
    trajs, _ = trainer.rollout(prompts, 1, True)
    eos = tuple(trainer.tokenizer.eos_ids)
    assert list(trajs[0].response) == trainer_greedy(trainer.model, list(prompts[0].ids), 16, eos)
    return metrics, trainer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sleep_mode_releases_vllm_memory_for_the_update_and_the_sync_still_lands() -> None:
    spec = {**SPEC, "rollout": {**SPEC["rollout"], "release_kv_for_update": True}, "resources": {"gpus": 1}}
    metrics, trainer = _greedy_matches_trainer_after_a_step(spec)
    assert "timing_s/sleep" in metrics and metrics["rollout/logp_abs_diff"] < 1e-3
    engine = trainer.rollout.engine  # type: ignore[attr-defined]
    trainer.rollout(trainer.sampler.rows[:1], 2, False)  # a training rollout ends asleep
    assert engine.sleeping == {"weights", "kv_cache"}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_two_gpus_serves_the_synced_weights() -> None:
    spec = {**SPEC, "resources": {"gpus": 2, "tensor_parallel": 2}}
    _greedy_matches_trainer_after_a_step(spec)
