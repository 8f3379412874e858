"""Presets and the README agree with the spec model: every preset validates, the README's presets table lists each
one, the README's example specs validate and the first runs on the quick-start machine (CPU), and `demo-cpu` is set
up to show the product (the real model, a task with reward variance, SD considered in the tail and switched by
measured step costs, a learned drafter that is exported).

Run: python -m pytest tests/train/test_train_presets.py -q
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from worker.tlt.config import PRESETS, JobSpec, preset

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_preset_validates_and_is_documented() -> None:
    text = README.read_text()
    for name in PRESETS:
        assert preset(name).name
        assert f"| `{name}` |" in text, f"preset {name} missing from the README's presets table"


def test_readme_specs_validate_and_the_first_runs_on_cpu() -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S)
    specs = [JobSpec.model_validate(yaml.safe_load(b)) for b in blocks]
    assert specs and specs[0].resources.gpus == 0
    for b, spec in zip(blocks, specs, strict=True):
        assert spec.resources.gpus == 0 or "GPU" in b, "a GPU spec must say so"


def test_demo_preset_shows_learning_sd_and_an_exported_drafter() -> None:
    d = preset("demo-cpu")
    assert d.model.builtin == "smollm2-135m-instruct" and d.resources.gpus == 0
    # the task's reward plus one the model learns in a few steps (test_train_demo_learns.py runs it), in [0, 1]
    # toy_times: the letter as many times as each prompt asks, so no constant answer is best (no collapse)
    assert d.dataset.builtin == "toy-times" and d.algorithm.reward_funcs == ["toy_times", "brevity"]
    assert d.algorithm.reward_weights is not None and sum(d.algorithm.reward_weights) == 1.0
    assert 8 <= d.max_steps <= 10  # enough steps for the reward to rise (test_train_demo_learns.py: at what lr)
    assert d.algorithm.loss_type == "grpo"  # each response weighs alike: long prose cannot drown the short answers
    batch = d.algorithm.num_generations * d.algorithm.prompts_per_step
    assert d.rollout.speculative == "adaptive" and d.rollout.sd_on_below >= batch  # considered once one response ends
    assert d.rollout.sd_switch == "step_costs"  # ... and kept only where measured costs say it pays (CPU: off)
    assert d.drafter.kind in ("eagle1", "eagle3") and d.drafter.export_kind == d.drafter.kind
    assert d.drafter.max_train_steps_per_rl_step > 0
