"""The quick start's demo learns: the `demo-cpu` preset's own model, task, rewards and optimiser settings raise the
mean reward within a few GRPO steps on CPU, and its rewards keep varying within groups (a GRPO signal) at every step. SD and the drafter are switched off here (they are lossless and cost CPU
time; they change which tokens are drawn, not what is learned), and the run is cut to 4 of the preset's 8 steps.

Run: python -m pytest tests/train/test_train_demo_learns.py -q      (about a minute on 2 idle cores)
"""

from pathlib import Path

import pytest

from worker.tlt.config import PRESETS, JobSpec
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.spec_file import merge_spec
from worker.tlt.train import run


@pytest.mark.slow
def test_demo_preset_reward_rises_within_four_steps(tmp_path: Path) -> None:
    spec = JobSpec.model_validate(merge_spec(PRESETS["demo-cpu"], {
        "rollout": {"speculative": "off", "kv_cache_gb": 0.25}, "drafter": {"kind": "none"}, "max_steps": 4}))
    run(spec, tmp_path, FileReporter(tmp_path))
    steps = [r["metrics"] for r in read_metrics(tmp_path)]
    assert len(steps) == 4
    first, late = steps[0], steps[1:]

    def late_mean(name: str) -> float:
        return sum(m[name] for m in late) / len(late)

    # SmolLM2's first answers are prose that mostly runs to the length limit; the policy learns to answer briefly ...
    assert first["reward/brevity/mean"] < 0.5 and first["response_length/clip_ratio"] > 0.3
    assert late_mean("reward/brevity/mean") > first["reward/brevity/mean"] + 0.2
    assert late_mean("response_length/mean") < first["response_length/mean"]
    # ... and the mean reward (half brevity, half the target-letter share) rises with it. With 8 responses a step
    # one step may dip (a burst of empty answers scores 0); the best later step is what a user sees rise.
    assert late_mean("reward/mean") > first["reward/mean"] + 0.05
    assert max(m["reward/mean"] for m in late) > first["reward/mean"] + 0.2
    # ... and the signal stays alive: at every step some group's responses score differently (toy_many pays for
    # many target letters, so short answers keep differing where one-letter answers once all scored the same)
    assert all(m["frac_reward_zero_std"] < 1.0 and m["reward/std"] > 0.01 for m in steps)
