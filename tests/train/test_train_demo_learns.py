"""The quick start's demo learns through all of its steps: the `demo-cpu` preset's own model, task, rewards and
optimiser settings raise the mean reward on CPU, and at every one of its 8 steps some GRPO group's responses score
differently (a learning signal): the policy does not settle on one answer. SD and the drafter are switched off here
(they are lossless and cost CPU time; they change which tokens are drawn, not what is learned).

Run: python -m pytest tests/train/test_train_demo_learns.py -q      (about two minutes on 2 idle cores)
"""

from pathlib import Path

import pytest

from worker.tlt.config import PRESETS, JobSpec
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.job_spec_file import merge_spec
from worker.tlt.train import run


@pytest.mark.slow
def test_demo_preset_learns_with_a_signal_at_every_step(tmp_path: Path) -> None:
    spec = JobSpec.model_validate(merge_spec(PRESETS["demo-cpu"], {
        "rollout": {"speculative": "off", "kv_cache_gb": 0.25}, "drafter": {"kind": "none"}}))
    run(spec, tmp_path, FileReporter(tmp_path))
    steps = [r["metrics"] for r in read_metrics(tmp_path)]
    assert len(steps) == spec.max_steps == 8
    first, late = steps[0], steps[4:]

    def mean(name: str, ms: list[dict]) -> float:
        return sum(m[name] for m in ms) / len(ms)

    # SmolLM2's first answers are prose that mostly runs to the length limit; the policy learns to answer briefly ...
    assert first["reward/brevity/mean"] < 0.5 and first["response_length/clip_ratio"] > 0.3
    assert mean("response_length/mean", late) < first["response_length/mean"]
    # ... without trading the task for brevity (runs of the asked letter score better than prose) ...
    assert mean("reward/toy_times/mean", steps[1:]) > first["reward/toy_times/mean"]
    # ... so the mean reward rises over the run (with 16 responses a step, one step may dip) and ends above where it
    # began (brevity alone drives a policy to empty answers, which score 0)
    assert mean("reward/mean", late) > first["reward/mean"] + 0.1
    assert steps[-1]["reward/mean"] > first["reward/mean"] and steps[-1]["response_length/mean"] >= 2
    # ... and the signal stays alive at every step: at least two of the four groups score unevenly. The best answer
    # depends on the prompt's letter and count, so no single answer takes every group's reward
    assert all(m["frac_reward_zero_std"] <= 0.5 and m["reward/std"] > 0.01 for m in steps), [
        (m["frac_reward_zero_std"], m["reward/std"]) for m in steps]
