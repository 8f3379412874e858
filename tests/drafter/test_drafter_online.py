"""OnlineDrafter in a simulated RL loop: capture during SD rollouts, spot training after the update, weights reach
the engine only at the next rollout start, checkpoints round-trip."""

from __future__ import annotations

import pytest
import torch

from worker.tlt.config import JobSpec
from worker.tlt.job_spec_translate import drafter_config
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.drafter.online import OnlineDrafter


def _spec(**drafter) -> JobSpec:
    return JobSpec.model_validate({
        "model": {"builtin": "tiny-llama"},
        "drafter": {"kind": "eagle1", "max_train_steps_per_rl_step": 6, "buffer_gb": 0.01, "learning_rate": 1e-2,
                    **drafter},
        "rollout": {"sd_on_below": 8},
    })


def test_rl_loop_capture_train_publish(tiny_target: Transformer) -> None:
    od = OnlineDrafter(drafter_config(_spec()), tiny_target)
    eng = Engine(tiny_target, eos_ids=(257,), config=EngineConfig(max_len=48, max_slots=4),
                 controller=AdaptiveSd.fixed(chain_arm("eagle", 3)), proposers={"eagle": od.proposer},
                 hidden_hook=od.hidden_hook)
    reqs = [Request([5, 6, 7, 8], RequestSampling(temperature=1.0, max_new_tokens=16, n=2)),
            Request([9, 10, 11], RequestSampling(temperature=1.0, max_new_tokens=16, n=2))]
    versions = []
    for step in range(3):
        od.begin_rollout(step)
        versions.append(od.proposer.version)
        serving = {k: v.clone() for k, v in od.proposer.drafter.state_dict().items()}
        out = eng.generate(reqs)
        assert od.observe_rollout(out) > 0
        assert len(od.buffer) > 0 and od.buffer.steps_held()[-1] == step
        m = od.after_update(step, [])
        assert m["drafter/steps"] == 6 * (step + 1) and "drafter/loss" in m
        # per step: the tail was offered, but no engine tail hook trained in it (the budget ran after the update)
        assert m["harvest/idle_gpu_s"] > 0 and m["harvest/used_gpu_s"] == 0 and m["harvest/ratio"] == 0
        assert m["harvest/idle_gpu_s_total"] >= m["harvest/idle_gpu_s"] and m["harvest/used_gpu_s_total"] == 0
        # training after the rollout did not edit the engine's copy
        assert all(torch.equal(serving[k], v) for k, v in od.proposer.drafter.state_dict().items())
    assert versions == [0, 1, 2]
    assert od.buffer.steps_held() == [1, 2]

    other = OnlineDrafter(drafter_config(_spec()), tiny_target)
    other.load_state_dict(od.state_dict())
    assert other.trainer.steps == od.trainer.steps
    for k, v in od.train_drafter.state_dict().items():
        assert torch.equal(other.train_drafter.state_dict()[k], v)
    # the engine's copy is what was serving (published at the last rollout start), until the next rollout starts
    for k, v in od.proposer.drafter.state_dict().items():
        assert torch.equal(other.proposer.drafter.state_dict()[k], v)
    assert other.proposer.version == od.proposer.version
    od.begin_rollout(3)
    other.begin_rollout(3)
    assert other.proposer.version == od.proposer.version == 3
    for k, v in od.train_drafter.state_dict().items():
        assert torch.equal(other.proposer.drafter.state_dict()[k], v)


@pytest.mark.parametrize("after_update", [True, False])
def test_harvest_is_per_step_and_never_above_the_idle_time(after_update: bool, tiny_target: Transformer) -> None:
    """Drafter steps between tail decode steps are harvested idle time; the rest of the budget, run after the update
    (unless drafter.train_after_update is off), is not. Per step used <= idle (ratio <= 1); the *_total counters add
    the steps up."""
    od = OnlineDrafter(drafter_config(_spec(train_after_update=after_update)), tiny_target)
    eng = Engine(tiny_target, eos_ids=(257,), config=EngineConfig(max_len=48, max_slots=4),
                 controller=AdaptiveSd.fixed(chain_arm("eagle", 3)), proposers={"eagle": od.proposer},
                 hidden_hook=od.hidden_hook)
    reqs = [Request([5, 6, 7, 8], RequestSampling(temperature=1.0, max_new_tokens=16, n=2))]
    idle_sum = used_sum = 0.0
    for step in range(3):
        od.begin_rollout(step)
        tail = od.observe_rollout(eng.generate(reqs))
        if step:  # a rollout's tail trains (the buffer holds the first rollout's rows from step 1 on)
            assert od.train_in_tail(lambda: False, max_steps=2) == 2
        m = od.after_update(step, [])
        # the whole budget ran either way; or only the tail's steps
        assert m["drafter/steps"] == (6 * (step + 1) if after_update else 2 * step)
        assert m["harvest/idle_gpu_s"] >= tail > 0 and 0 <= m["harvest/ratio"] <= 1
        assert (m["harvest/used_gpu_s"] > 0) == (step > 0)
        assert m["harvest/ratio"] == pytest.approx(m["harvest/used_gpu_s"] / m["harvest/idle_gpu_s"])
        idle_sum += m["harvest/idle_gpu_s"]
        used_sum += m["harvest/used_gpu_s"]
        assert m["harvest/idle_gpu_s_total"] == pytest.approx(idle_sum)
        assert m["harvest/used_gpu_s_total"] == pytest.approx(used_sum)


def test_online_drafter_needs_a_learned_kind(tiny_target: Transformer) -> None:
    with pytest.raises(ValueError, match="eagle1 or eagle3"):
        OnlineDrafter(drafter_config(_spec(kind="ngram")), tiny_target)


def test_hook_rows_of_the_wrong_width_are_refused(tiny_target: Transformer) -> None:
    # an EAGLE-3 drafter on an engine built without its capture_layers would train on the final hidden only
    od = OnlineDrafter(drafter_config(_spec(kind="eagle3")), tiny_target)
    with pytest.raises(ValueError, match="capture_layers"):
        od.hidden_hook([(0, 0)], torch.tensor([1]), torch.zeros(1, tiny_target.args.dim))


def test_draft_vocab_is_picked_from_the_responses_and_checkpointed(tiny_target: Transformer) -> None:
    """drafter.draft_vocab_size: the first rollout drafts over every token; each later rollout start re-picks the
    most frequent tokens of all responses so far, in place (the same tensor: captured graphs stay valid); a
    checkpoint restores the counts and the set."""
    od = OnlineDrafter(drafter_config(_spec(draft_vocab_size=40)), tiny_target)
    eng = Engine(tiny_target, eos_ids=(257,), config=EngineConfig(max_len=48, max_slots=4),
                 controller=AdaptiveSd.fixed(chain_arm("eagle", 3)), proposers={"eagle": od.proposer},
                 hidden_hook=od.hidden_hook)
    reqs = [Request([5, 6, 7, 8], RequestSampling(temperature=1.0, max_new_tokens=16, n=2))]
    od.begin_rollout(0)
    assert od.proposer.draft_vocab is None
    out = eng.generate(reqs)
    od.observe_rollout(out)
    assert int(od.token_counts.sum()) == sum(len(s.tokens) for s in out.sequences)
    od.begin_rollout(1)
    vocab = od.proposer.draft_vocab
    assert vocab is not None and vocab.numel() == 40
    counts = od.token_counts
    assert int(counts[vocab].min()) >= int(counts[~torch.isin(torch.arange(counts.numel()), vocab)].max())
    held = od.proposer._vocab
    od.observe_rollout(eng.generate(reqs))  # drafts inside the set (test_drafter_vocab.py checks the drafts)
    od.begin_rollout(2)
    assert od.proposer._vocab is held  # re-picked in place
    again = od.proposer.draft_vocab
    assert again is not None and int(counts[again].min()) >= int(
        counts[~torch.isin(torch.arange(counts.numel()), again)].max())
    other = OnlineDrafter(drafter_config(_spec(draft_vocab_size=40)), tiny_target)
    other.load_state_dict(od.state_dict())
    assert torch.equal(other.token_counts, od.token_counts)
    other_vocab = other.proposer.draft_vocab
    assert other_vocab is not None and torch.equal(other_vocab, again)
