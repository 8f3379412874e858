"""AdaptiveSd: the per-step glue the engine calls. Run: `python -m pytest tests/adaptive/test_adaptive_controller.py -q`."""

from __future__ import annotations

import json

from worker.tlt.config import RolloutConfig
from worker.tlt.speculative.arm import NO_SD
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.control.sim import SimEnv, response_lengths, simulate_rollout


def drive(ctl: AdaptiveSd, env: SimEnv, lengths: list[int]) -> None:
    """The engine's loop in miniature: plan, simulate the step, record."""
    ctl.start_rollout()
    remaining = list(lengths)
    while remaining:
        active = len(remaining)
        arm = ctl.plan(active)
        acc = [min(env.accepted(arm), r - 1) for r in remaining]
        ctl.record(active, arm, active + sum(acc), env.model.step_s(arm, active),
                   accepted_per_pos=[sum(a >= k for a in acc) for k in range(1, arm.depth + 1)])
        remaining = [r - 1 - a for r, a in zip(remaining, acc, strict=True) if r - 1 - a > 0]


def test_modes_from_the_job_spec() -> None:
    off = AdaptiveSd.from_spec(RolloutConfig(speculative="off"), ["ngram"])
    assert all(off.plan(a) == NO_SD for a in (1, 1, 1, 1)) and off.bandit is None
    on = AdaptiveSd.from_spec(RolloutConfig(speculative="on", draft_depth=4, draft_topk=2, verify_tokens=8), ["eagle"])
    arm = on.plan(512)
    assert (arm.drafter, arm.depth, arm.topk, arm.verify_tokens) == ("eagle", 4, 2, 8)
    assert on.plan(512) == arm  # fixed arm, every step, any batch
    ngram_on = AdaptiveSd.from_spec(RolloutConfig(speculative="on", draft_depth=3, draft_topk=2, verify_tokens=8),
                                    ["ngram"])
    arm = ngram_on.plan(1)  # the n-gram drafter drafts the spec's tree too: one shape whatever the drafter
    assert (arm.drafter, arm.depth, arm.topk, arm.verify_tokens) == ("ngram", 3, 2, 8)
    fixed = AdaptiveSd.fixed(on.fixed_arm)
    assert fixed.plan(1) == fixed.plan(512) == on.fixed_arm and fixed.bandit is None
    ada = AdaptiveSd.from_spec(RolloutConfig(sd_on_below=8, sd_patience=2, bandit="ucb"), ["ngram"])
    assert ada.bandit is not None and ada.bandit.kind == "ucb"
    assert [ada.plan(a) == NO_SD for a in (16, 4)] == [True, True] and not ada.switch.on
    assert ada.plan(4) == NO_SD and ada.switch.on  # switch on; the bandit measures "none" first
    ada.record(4, NO_SD, 4, 0.01)
    ada.record(4, ada.plan(4), 4, 0.01)
    assert ada.plan(4).name == "ngram-c3"  # then the next arm in table order
    assert ada.metrics.summary()["sd/arm/none"] == 2


def test_adaptive_rollout_beats_sd_off_and_reports_metrics() -> None:
    lengths = response_lengths(64, seed=0)
    spec = RolloutConfig(sd_on_below=32, sd_patience=3, bandit="epsilon_greedy")
    ctl, off = AdaptiveSd.from_spec(spec, ["ngram"]), AdaptiveSd.from_spec(RolloutConfig(speculative="off"), ["ngram"])
    env = SimEnv({"ngram": 0.6}, seed=0)
    for _ in range(3):  # the bandit learns across rollouts
        drive(ctl, env, lengths)
    drive(off, env, lengths)
    s, s_off = ctl.metrics.summary(), off.metrics.summary()
    assert 0 < s["sd/on_fraction"] < 1 and s["sd/accept_len"] > 1.3
    assert s["perf/tokens_per_s_tail"] > 1.3 * s_off["perf/tokens_per_s_tail"]
    assert sum(v for k, v in s.items() if k.startswith("sd/arm/")) == ctl.metrics.sd_on_steps
    # the library's own rollout simulator agrees with the controller loop on the SD-off baseline
    ref = simulate_rollout(SimEnv({"ngram": 0.6}, seed=0), lengths, {}, "off")
    assert ref.full.tokens + ref.tail.tokens == off.metrics.full.tokens + off.metrics.tail.tokens == sum(lengths)


def test_new_drafter_and_checkpoint() -> None:
    ctl = AdaptiveSd.from_spec(RolloutConfig(), ["ngram"])
    assert ctl.bandit is not None
    assert not any(a.drafter == "eagle" for a in ctl.bandit.arms(0))
    ctl.set_drafters(["ngram", "eagle"])
    assert any(a.drafter == "eagle" for a in ctl.bandit.arms(0))
    drive(ctl, SimEnv({"ngram": 0.5, "eagle": 0.7}, seed=1), response_lengths(48, seed=1))
    state = json.loads(json.dumps(ctl.state_dict()))
    fresh = AdaptiveSd.from_spec(RolloutConfig(), ["ngram"])
    fresh.load_state_dict(state)
    assert fresh.bandit is not None and fresh.bandit.to_dict() == ctl.bandit.to_dict()


def test_first_sd_step_of_an_arm_in_a_bucket_teaches_nothing() -> None:
    """Its seconds include the graph captures: the bandit and the step costs skip it, the metrics count it."""
    from worker.tlt.speculative.control.step_costs import StepCostConfig

    ctl = AdaptiveSd.from_spec(RolloutConfig(sd_on_below=8, sd_patience=1), ["ngram"], step_costs=StepCostConfig())
    assert ctl.bandit is not None and ctl.costs is not None
    arm = next(a for a in ctl.bandit.arms(ctl.scheme.bucket(4)) if a.is_sd)
    ctl.record(4, arm, 8, 2.5)  # a first use: 2.5 s
    first = ctl.costs.buckets[ctl.scheme.bucket(4)]
    assert first.sd_n == 0 and not first.arms and ctl.costs.observed_s == 2.5 and ctl.bandit.to_dict() == AdaptiveSd.from_spec(
        RolloutConfig(sd_on_below=8, sd_patience=1), ["ngram"]).bandit.to_dict()  # type: ignore[union-attr]
    assert ctl.metrics.sd_on_steps + ctl.metrics.full.tokens + ctl.metrics.tail.tokens > 0
    ctl.record(4, arm, 8, 0.01)  # the same arm again: learned
    assert ctl.costs.buckets[ctl.scheme.bucket(4)].sd_n == 1
    ctl.record(12, arm, 24, 2.5)  # another bucket: a first use again
    assert ctl.scheme.bucket(12) not in ctl.costs.buckets or ctl.costs.buckets[ctl.scheme.bucket(12)].sd_n == 0


def test_an_arm_that_cannot_pay_leaves_its_bucket_and_larger_ones() -> None:
    """An eager EAGLE tree at a 7B-class width measured 0.5 s per step against 5 ms plain steps: even at full
    acceptance (depth + 1 tokens per sequence) it cannot pay, so after two measured steps the bandit no longer has it
    in that bucket nor in larger ones (a smaller batch keeps it), also after the drafters change."""
    from worker.tlt.speculative.control.step_costs import StepCostConfig

    ctl = AdaptiveSd.from_spec(RolloutConfig(sd_on_below=64), ["ngram", "eagle"], step_costs=StepCostConfig())
    assert ctl.bandit is not None
    b = ctl.scheme.bucket(4)
    tree = next(a for a in ctl.bandit.arms(b) if a.topk > 1)
    chain = next(a for a in ctl.bandit.arms(b) if a.is_sd and a.topk == 1)
    below = [ctl.scheme.bucket(n) for n in (1, 2)]

    def trees(x: int) -> int:  # the tree's shape in bucket x (its verify width, and so its name, is the bucket's)
        return sum((a.drafter, a.depth, a.topk) == (tree.drafter, tree.depth, tree.topk) for a in ctl.bandit.arms(x))

    assert all(trees(x) == 1 for x in below)
    for _ in range(4):
        ctl.record(4, NO_SD, 4, 0.005)
    ctl.record(4, chain, 8, 0.007)  # first uses: captures, not measured
    ctl.record(4, tree, 8, 0.65)
    ctl.record(4, chain, 8, 0.007)  # 2 tokens per sequence for 1.4 plain steps: may pay
    ctl.record(4, tree, 8, 0.5)  # > 7 tokens' worth of plain steps, once: it could be a pause
    assert trees(b) == 1
    ctl.record(4, tree, 8, 0.52)  # twice: the arm's shape is out
    for x in range(b, ctl.scheme.num_buckets):
        assert trees(x) == 0 and NO_SD in ctl.bandit.arms(x)
    assert chain in ctl.bandit.arms(b)
    assert all(trees(x) == 1 for x in below)
    ctl.set_drafters(["ngram", "eagle"])
    assert trees(b) == 0 and trees(b + 1) == 0 and all(trees(x) == 1 for x in below)
    assert all(ctl.plan(4) != tree for _ in range(50))
