"""The training loop on a CUDA GPU (run by the lead on the H200; never by CI): SmolLM2 in bf16 trains through fp32
master weights that live on the GPU, the engine's weights are the rounded copies after every step, rewards stream in
from the engine's on_finish callback, and both the SD-off and the TLT preset run steps with finite metrics.

Run: python -m pytest -m gpu tests/train/test_train_gpu.py -q
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from worker.tlt.build import build_trainer
from worker.tlt.config import PRESETS, JobSpec
from worker.tlt.file_reporter import FileReporter
from worker.tlt.job_spec_file import merge_spec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["h200-gsm8k-sd-off", "h200-gsm8k-tlt"])
def test_bf16_steps_on_gpu_with_master_weights(tmp_path: Path, preset: str) -> None:
    assert torch.cuda.is_available()
    spec = JobSpec.model_validate(merge_spec(PRESETS[preset], {
        "algorithm": {"prompts_per_step": 2, "num_generations": 4, "max_completion_length": 128,
                      "learning_rate": 1e-6},
        "rollout": {"sd_on_below": 6, "kv_cache_gb": 2.0},
        "dataset": {"validation_size": 0},
        "max_steps": 2,
    }))
    trainer, _ = build_trainer(spec, FileReporter(tmp_path))
    assert trainer.model.head_weight.dtype == torch.bfloat16 and trainer.master.pairs
    assert trainer.rollout.streams_finished  # type: ignore[attr-defined]
    before = [m.detach().clone() for _, m in trainer.master.pairs]
    score = trainer.score

    def spread(trajs):  # GSM8K at 128 tokens often scores every sample 0: zero advantages, zero gradients
        rewards, metrics = score(trajs)
        return rewards + 0.1 * torch.arange(len(rewards), dtype=rewards.dtype), metrics

    trainer.score = spread  # type: ignore[method-assign]
    for _ in range(2):
        metrics, _, _ = trainer.step()
        assert all(math.isfinite(v) for v in metrics.values())
        assert metrics["timing_s/reward_work"] > 0
    moved = 0
    for (p, m), b in zip(trainer.master.pairs, before, strict=True):
        assert m.device.type == "cuda" and m.dtype == torch.float32
        assert torch.equal(p, m.to(torch.bfloat16))
        moved += int((m != b).sum())
    assert moved > 0  # lr 1e-6: mostly below a bf16 ulp, yet the fp32 copies moved
    trainer.close()
