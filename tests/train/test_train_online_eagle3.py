"""An RL run with the EAGLE-3 drafter trained online (train.run, `rollout.speculative: adaptive`, drafter.kind
eagle3): the engine captures the drafter's three feature layers, the drafter/* metrics are reported, the spot trainer
changes the drafter's weights, the engine serves them from the next rollout on, and rollouts stay lossless.
The builtin tiny-llama has 2 layers; EAGLE-3 reads layers (2, L//2, L-3), so the run loads a 4-layer tiny-llama.
Run: python -m pytest tests/train/test_train_online_eagle3.py -q"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.specs import toy_spec
from worker.tlt.config import JobSpec
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.model import load as model_load
from worker.tlt.model.args import ModelArgs
from worker.tlt.rl.checkpoint import load_checkpoint
from worker.tlt.train import run


@pytest.fixture
def four_layer_tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    real = model_load.preset

    def preset(name: str, **overrides: Any) -> ModelArgs:
        return real(name, **{"n_layers": 4, **overrides})

    monkeypatch.setattr(model_load, "preset", preset)


def _spec() -> JobSpec:
    return toy_spec(
        name="toy-eagle3",
        algorithm={"max_completion_length": 16},
        # the threshold switch: on CPU the default cost switch rightly keeps SD off, and this test must see it run
        rollout={"speculative": "adaptive", "sd_on_below": 9, "sd_patience": 1, "sd_switch": "active_batch"},
        drafter={"kind": "eagle3", "max_train_steps_per_rl_step": 3, "buffer_gb": 0.01},
        max_steps=2,
        save_steps=1,
    )


def test_eagle3_online_run(tmp_path: Path, four_layer_tiny: None) -> None:
    run(_spec(), tmp_path, FileReporter(tmp_path))
    recs = read_metrics(tmp_path)
    assert len(recs) == 2
    for r in recs:
        m = r["metrics"]
        assert m["sd/on_fraction"] == 1.0  # 8 sequences < sd_on_below: SD on from the first step
        assert m["rollout/logp_abs_diff"] < 1e-4  # lossless
        assert m["drafter/loss"] > 0 and 0.0 <= m["drafter/acc"] <= 1.0
    assert recs[-1]["metrics"]["drafter/steps"] == 6
    # step 1: the engine served the initial weights while the spot trainer moved its own copy
    d1 = load_checkpoint(tmp_path / "checkpoints/step-1").extra["drafter"]
    trained, served = d1["trainer"]["drafter"], d1["serving"]
    assert trained["fc.weight"].shape == served["fc.weight"].shape == (64, 3 * 64)  # EAGLE-3 features: 3H
    assert any(not torch.equal(trained[k], served[k]) for k in trained)
    # step 2: those trained weights were published to the engine at the rollout start
    d2 = load_checkpoint(tmp_path / "checkpoints/step-2").extra["drafter"]
    assert all(torch.equal(trained[k], d2["serving"][k]) for k in trained)
    assert d2["buffer"] is not None
    cfg = json.loads((tmp_path / "drafter/config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
