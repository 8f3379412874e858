"""EAGLE-3 trained online: the engine built with the drafter's `capture_layers` feeds its buffer [N, 4H] rows (3 layer
features + the final hidden), spot training changes the weights that reach the engine at the next rollout, and greedy
SD with the EAGLE-3 drafter stays token-identical to plain greedy decoding (lossless), chain and tree.
Run: python -m pytest tests/drafter/test_drafter_online_eagle3.py -q"""

from __future__ import annotations

import pytest
import torch

from worker.tlt.config import JobSpec
from worker.tlt.job_spec_translate import drafter_config
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, GenerationOutput, Request, RequestSampling
from worker.tlt.speculative.arm import Arm, chain_arm, tree_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.drafter.model import eagle3_layers
from worker.tlt.speculative.drafter.online import OnlineDrafter


def _spec(topk: int = 1, **drafter) -> JobSpec:
    return JobSpec.model_validate({
        "model": {"builtin": "tiny-llama"},
        "drafter": {"kind": "eagle3", "max_train_steps_per_rl_step": 4, "buffer_gb": 0.01, "learning_rate": 1e-2,
                    **drafter},
        "rollout": {"sd_on_below": 8, "draft_topk": topk},
    })


def _engine(target: Transformer, od: OnlineDrafter | None, arm: Arm | None) -> Engine:
    """Plain decoding (no drafter), or SD with the online drafter and one arm."""
    if od is None or arm is None:
        return Engine(target, eos_ids=(257,), config=EngineConfig(max_len=48, max_slots=4))
    return Engine(target, eos_ids=(257,), config=EngineConfig(max_len=48, max_slots=4, capture_layers=od.capture_layers),
                  controller=AdaptiveSd.fixed(arm), proposers={"eagle": od.proposer}, hidden_hook=od.hidden_hook)


def _drafted(out: GenerationOutput) -> int:
    return sum(sum(s.drafted_pos) for s in out.steps if s.kind == "spec")


REQS = [Request([5, 6, 7, 8], RequestSampling(temperature=1.0, max_new_tokens=14, n=2)),
        Request([9, 10, 11], RequestSampling(temperature=1.0, max_new_tokens=14, n=2))]


def test_eagle3_online_loop_trains_and_publishes(tiny_target: Transformer) -> None:
    od = OnlineDrafter(drafter_config(_spec()), tiny_target)
    h = tiny_target.args.dim
    assert od.capture_layers == eagle3_layers(tiny_target.args.n_layers)
    assert od.buffer.width == 4 * h and od.proposer.drafter.feature_dim == 3 * h
    eng = _engine(tiny_target, od, chain_arm("eagle", 3))
    initial = {k: v.clone() for k, v in od.train_drafter.trainable_state_dict().items()}
    for step in range(2):
        od.begin_rollout(step)
        out = eng.generate(REQS)
        assert _drafted(out) > 0  # the EAGLE-3 proposer drafted from the 3-layer features
        od.observe_rollout(out)
        assert len(od.buffer) > 0
        m = od.after_update(step, [])
        assert m["drafter/steps"] == 4 * (step + 1) and torch.isfinite(torch.tensor(m["drafter/loss"]))
    trained = od.train_drafter.trainable_state_dict()
    assert any(not torch.equal(initial[k], trained[k]) for k in ("fc.weight", "lm_head.weight"))
    od.begin_rollout(2)  # the trained weights reach the engine at the next rollout start
    for k, v in trained.items():
        torch.testing.assert_close(od.proposer.drafter.state_dict()[k], v.to(od.proposer.drafter.state_dict()[k]))


@pytest.mark.parametrize("arm", [chain_arm("eagle", 4), tree_arm("eagle", 3, 2, 7)], ids=["chain", "tree"])
def test_eagle3_greedy_sd_is_lossless(tiny_target: Transformer, arm: Arm) -> None:
    od = OnlineDrafter(drafter_config(_spec(topk=arm.topk)), tiny_target)
    eng = _engine(tiny_target, od, arm)
    greedy = [Request([5, 6, 7, 8], RequestSampling(temperature=0.0, max_new_tokens=20)),
              Request([40, 41], RequestSampling(temperature=0.0, max_new_tokens=20)),
              Request([9, 10, 11, 12, 13], RequestSampling(temperature=0.0, max_new_tokens=20))]
    # a little training first, until drafts are partly accepted (which rollout gets there depends on the sampled
    # training rollouts): both the accept and the roll-back paths run
    for step in range(8):
        od.begin_rollout(step)
        od.observe_rollout(eng.generate(REQS))
        od.after_update(step, [])
        od.begin_rollout(step + 1)
        sd = eng.generate(greedy)
        accepted = sum(s.accepted for s in sd.steps if s.kind == "spec")
        if 0 < accepted < _drafted(sd):
            break
    assert 0 < accepted < _drafted(sd)  # partial acceptance: both the accept and the roll-back paths ran
    plain = _engine(tiny_target, None, None).generate(greedy)
    assert [s.tokens for s in sd.sequences] == [s.tokens for s in plain.sequences]
