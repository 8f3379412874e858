"""What a CPU job prints about itself: no GPU memory warning (on CPU the update plan's budgets are host memory and
its activation estimate a worst case), and a step line whose loss never reads -0.0000.

Run: python -m pytest tests/train/test_train_cpu_words.py -q
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from worker.tlt.config import JobSpec
from worker.tlt.data.dataset import load_examples, split_examples
from worker.tlt.data.prompts import render_examples
from worker.tlt.model.load import load_model
from worker.tlt.rewards.registry import resolve
from worker.tlt.rl.engine_adapter import make_rollout
from worker.tlt.rl.loop import step_line
from worker.tlt.rl.trainer import GRPOTrainer
from worker.tlt.rl.update_plan import UpdatePlan
from worker.tlt.rl.updater import TorchUpdate

# an estimate over its budget, as a SmolLM2 update's worst-case activations are on a 25 GB host
OVER = UpdatePlan("torch", 0, False, gpu_bytes=23.9e9, host_bytes=0.0, gpu_budget=22.7e9, host_budget=20.2e9)


def test_cpu_job_gets_no_gpu_fit_warning(toy_spec: Callable[..., JobSpec], caplog: pytest.LogCaptureFixture) -> None:
    spec = toy_spec()
    model, tok = load_model(spec.model)
    rows, _ = split_examples(load_examples(spec.dataset), 0)
    rollout = make_rollout(spec, model, tok, torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="worker.tlt.rl.trainer"):
        GRPOTrainer(spec, model, tok, rollout, render_examples(rows, tok, None, 64), resolve(["toy_count"]),
                    device="cpu", updater=TorchUpdate(model, spec.algorithm, OVER))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    text = caplog.text
    assert "GPU" not in text and "host memory" in text


@pytest.mark.parametrize("loss", [-1e-7, -0.0, 0.0, 3e-6])
def test_step_line_loss_has_no_negative_zero(toy_spec: Callable[..., JobSpec], loss: float) -> None:
    m = {"reward/mean": 0.5, "actor/pg_loss": loss, "response_length/mean": 12.0, "timing_s/step": 1.5}
    line = step_line(toy_spec(), 2, m, world=1)
    assert "loss 0.0000 " in line and "-0.0000" not in line
