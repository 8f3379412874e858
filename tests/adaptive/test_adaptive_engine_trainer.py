"""`rollout.speculative: adaptive` in the GRPO loop (rl/engine_adapter.py): the engine gets an AdaptiveSd controller
with the n-gram drafter (plus EAGLE and its tail hook when drafter.kind is eagle1), the rollout's sd/* and perf/*
metrics reach the trainer's reported metrics, and rollouts stay lossless (the verifier's log-probs are the policy's).
Run: python -m pytest tests/adaptive/test_adaptive_engine_trainer.py -q"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.specs import toy_spec
from worker.tlt.config import JobSpec
from worker.tlt.file_reporter import FileReporter, read_metrics
from worker.tlt.model.load import load_model
from worker.tlt.rl.engine_adapter import make_rollout
from worker.tlt.train import run


def _spec(kind: str) -> JobSpec:
    return toy_spec(
        name="toy-adaptive",
        algorithm={"max_completion_length": 24},
        # the threshold switch: on CPU the default cost switch rightly keeps SD off, and this test must see it run
        rollout={"speculative": "adaptive", "sd_on_below": 9, "sd_patience": 1, "sd_switch": "active_batch"},
        drafter={"kind": kind, "max_train_steps_per_rl_step": 3, "buffer_gb": 0.01},
        max_steps=2,
    )


def test_make_rollout_builds_the_adaptive_engine() -> None:
    spec = _spec("eagle1")
    model, tok = load_model(spec.model, "cpu")
    rollout = make_rollout(spec, model, tok, torch.device("cpu"))
    eng = rollout.engine
    assert eng.controller is not None and sorted(eng.proposers) == ["eagle", "ngram"]
    assert rollout.drafter is not None and eng.proposers["eagle"] is rollout.drafter.proposer
    assert eng.tail.hook is not None and eng.hidden_hook is not None
    assert {a.drafter for a in eng.controller.all_arms()} == {"none", "ngram", "eagle"}
    ngram_only = make_rollout(_spec("ngram"), model, tok, torch.device("cpu")).engine
    assert sorted(ngram_only.proposers) == ["ngram"] and ngram_only.tail.hook is None


@pytest.mark.parametrize("kind", ["ngram", "eagle1"])
def test_adaptive_rollout_in_the_loop(tmp_path: Path, kind: str) -> None:
    run(_spec(kind), tmp_path, FileReporter(tmp_path))
    recs = read_metrics(tmp_path)
    assert len(recs) == 2
    for r in recs:
        m = r["metrics"]
        assert m["sd/on_fraction"] == 1.0  # 8 sequences < sd_on_below: SD on from the first step
        assert any(k.startswith("sd/arm/") for k in m) and m["perf/tokens_per_s_tail"] > 0
        assert m["rollout/logp_abs_diff"] < 1e-4  # lossless
        assert (m.get("perf/tail_hook_calls", 0) > 0) == (kind == "eagle1")  # spot training between tail steps
    if kind == "eagle1":
        assert recs[-1]["metrics"]["drafter/steps"] == 6  # the tail's steps count against the per-step cap


@pytest.mark.parametrize(("mode", "kind", "drafters", "controlled", "tail", "warns"), [
    ("adaptive", "eagle1", ("ngram", "eagle"), True, True, False),
    ("adaptive", "eagle3", ("ngram", "eagle"), True, True, False),
    ("adaptive", "ngram", ("ngram",), True, False, False),
    ("adaptive", "none", ("ngram",), True, False, True),
    ("on", "eagle1", ("eagle",), True, False, False),
    ("on", "ngram", ("ngram",), True, False, False),
    ("on", "none", (), False, False, True),
    ("off", "eagle1", (), True, False, False),
])
def test_speculation_is_translated_from_the_spec(mode: str, kind: str, drafters: tuple, controlled: bool,
                                                 tail: bool, warns: bool) -> None:
    from worker.tlt.job_spec_translate import speculation

    spec = _spec(kind).model_copy(update={"rollout": _spec(kind).rollout.model_copy(update={"speculative": mode})})
    sd = speculation(spec)
    assert (sd.drafters, sd.controlled, sd.tail_training, sd.warning is not None) == (drafters, controlled, tail, warns)
    assert sd.learned == ("eagle" in drafters)


def test_a_rank_s_rollout_has_no_tail_training() -> None:
    """Data parallelism builds the engine without the drafter's tail hook (each rank would train its own copy)."""
    spec = _spec("eagle1")
    model, tok = load_model(spec.model, "cpu")
    eng = make_rollout(spec, model, tok, torch.device("cpu"), tail_training=False).engine
    assert sorted(eng.proposers) == ["eagle", "ngram"] and eng.tail.hook is None and eng.hidden_hook is not None
