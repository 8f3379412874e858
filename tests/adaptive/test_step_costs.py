"""SD switched by measured step costs (speculative/control/step_costs.py), on synthetic costs: it stays off where SD cannot pay
(a launch-bound 135M model: an SD step costs several plain steps) within its probing budget of SD off, and turns on
where it pays (a memory-bound 7B-class target: a verify costs about one plain step), above TLT's fixed 32 as well.
Run: python -m pytest tests/adaptive/test_step_costs.py -q"""

from __future__ import annotations

import io
import math

import torch

from worker.tlt.config import RolloutConfig
from worker.tlt.speculative.arm import NO_SD
from worker.tlt.speculative.control.arm_buckets import ONE_GPU_BUCKETS, arms_table
from worker.tlt.speculative.control.bandit import BanditConfig, make_bandit
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.control.sim import SimCostModel, SimEnv, response_lengths
from worker.tlt.speculative.control.step_costs import BucketCosts, StepCostConfig, StepCosts
from worker.tlt.speculative.control.switch import SwitchConfig

SMALL = SimCostModel(target_fixed_s=0.63e-3, target_sat_tokens=4096, sd_overhead_s=1.5e-3, noise=0.05)
WIDE = SimCostModel(target_fixed_s=5e-3, target_sat_tokens=1024, sd_overhead_s=0.2e-3, noise=0.05)


def controller(costs: StepCosts | None, sd_below: int = 128) -> AdaptiveSd:
    table = arms_table(["ngram"], ONE_GPU_BUCKETS)
    switch = SwitchConfig(mode="adaptive", on_below=32, patience=3, off_at=sd_below)
    return AdaptiveSd(switch, make_bandit(table, BanditConfig(), seed=0), scheme=ONE_GPU_BUCKETS, costs=costs)


def rollout(ctl: AdaptiveSd | None, env: SimEnv, lengths: list[int]) -> tuple[float, dict[int, int]]:
    """Simulated seconds of one rollout (sequences advance by their own accepted length) and SD steps per active
    batch size. ctl None = SD off."""
    left, seconds = list(lengths), 0.0
    sd_steps: dict[int, int] = {}
    if ctl is not None:
        ctl.start_rollout()
    while any(n > 0 for n in left):
        live = [i for i, n in enumerate(left) if n > 0]
        active = len(live)
        arm = ctl.plan(active) if ctl is not None else NO_SD
        advance = [1 + env.accepted(arm) for _ in live]
        dt = env.model.step_s(arm, active) * math.exp(env.rng.gauss(0.0, env.model.noise))
        for i, a in zip(live, advance, strict=True):
            left[i] -= a
        emitted = sum(advance)
        if ctl is not None:
            ctl.record(active, arm, emitted, dt)
        if arm.is_sd:
            sd_steps[active] = sd_steps.get(active, 0) + 1
        seconds += dt
    return seconds, sd_steps


def test_sd_stays_off_where_it_cannot_pay() -> None:
    lengths = response_lengths(64, seed=1)
    off, _ = rollout(None, SimEnv({"ngram": 0.3}, SMALL, seed=0), lengths)
    costs = StepCosts(StepCostConfig(), ONE_GPU_BUCKETS)
    ctl = controller(costs)
    runs = [rollout(ctl, SimEnv({"ngram": 0.3}, SMALL, seed=s), lengths) for s in range(3)]
    assert all(t <= off * 1.02 for t, _ in runs), (off, [t for t, _ in runs])
    # judged off: the third rollout barely drafts (a bucket is judged after its arms' first uses, which teach nothing)
    assert sum(runs[-1][1].values()) <= 3
    assert all(v == 0.0 for k, v in costs.summary().items() if k.startswith("sd/pays/"))


def test_sd_turns_on_where_it_pays_even_above_32_active() -> None:
    lengths = response_lengths(64, seed=2)
    env_off = SimEnv({"ngram": 0.7}, WIDE, seed=0)
    off, _ = rollout(None, env_off, lengths)
    costs = StepCosts(StepCostConfig(), ONE_GPU_BUCKETS)
    ctl = controller(costs)
    t, sd_steps = rollout(ctl, SimEnv({"ngram": 0.7}, WIDE, seed=0), lengths)
    assert t < 0.8 * off, (t, off)
    assert any(n >= 32 for n in sd_steps)  # a fixed threshold of 32 would never draft there
    assert costs.summary()["sd/pays/1"] == 1.0


def test_threshold_switch_unchanged_without_costs() -> None:
    ctl = controller(None)
    assert type(ctl.switch).__name__ == "SdSwitch"
    assert not any(ctl.plan(100).is_sd for _ in range(5))  # at or above the off point: plain


def test_warmup_costs_rule_out_a_bucket_without_probing() -> None:
    costs = StepCosts(StepCostConfig(min_plain=1), ONE_GPU_BUCKETS)
    b = ONE_GPU_BUCKETS.bucket(1)
    costs.prime(b, plain_s=0.6e-3, sd_s=5e-3, best_emitted=5.0)  # even 5 tokens per step: 1.0 ms each > 0.6 ms
    costs.observe(1, False, 1, 0.6e-3)
    assert not costs.sd_pays(b)
    costs.prime(b, plain_s=5e-3, sd_s=5.5e-3, best_emitted=5.0)
    assert costs.sd_pays(b)  # may pay: probed


def test_judged_bucket_hysteresis_and_reprobe() -> None:
    cfg = StepCostConfig(min_plain=2, probe_steps=2, reprobe_every=5, probe_budget=1.0)
    costs = StepCosts(cfg, ONE_GPU_BUCKETS)
    b = ONE_GPU_BUCKETS.bucket(4)
    for _ in range(2):
        costs.observe(4, False, 4, 1.0)
    assert costs.sd_pays(b)  # unjudged: probe
    for _ in range(2):
        costs.observe(4, True, 4 * 3, 1.5)  # 3 tokens per sequence for 1.5 plain steps: gain 2
    assert costs.sd_pays(b) and costs.summary()["sd/gain/3-4"] == 2.0
    for _ in range(30):  # drafts turn useless: 1 token per 1.5 plain steps pulls the mean below parity
        costs.observe(4, True, 4, 1.5)
    assert not costs.sd_pays(b)
    for _ in range(cfg.reprobe_every):
        costs.observe(4, False, 4, 1.0)
    assert costs.sd_pays(b)  # probed again: a learned drafter may have improved


def test_a_bucket_is_judged_by_its_best_arm() -> None:
    """A slow arm (an eager tree at a large width: 40 plain steps) mixed with one that pays (3 tokens per sequence for
    1.5 plain steps) turns SD on; the summary's gain is the paying arm's."""
    cfg = StepCostConfig(min_plain=1, probe_steps=4, probe_budget=1.0)
    costs = StepCosts(cfg, ONE_GPU_BUCKETS)
    b = ONE_GPU_BUCKETS.bucket(4)
    costs.observe(4, False, 4, 0.01)
    for _ in range(2):
        costs.observe(4, True, 4 * 2, 0.4, arm="eagle-d6k4v24")
        costs.observe(4, True, 4 * 3, 0.015, arm="eagle-c3")
    assert costs.buckets[b].on is True and costs.sd_pays(b)
    assert math.isclose(costs.summary()["sd/gain/3-4"], 2.0)
    for _ in range(30):  # the good arm turns useless too: now no arm pays
        costs.observe(4, True, 4, 0.015, arm="eagle-c3")
    assert not costs.sd_pays(b)


def test_one_slow_first_use_spends_the_probing_budget_but_does_not_rule_sd_out() -> None:
    """A first SD step that compiles (hundreds of plain steps long) counts in the means as at most `outlier` plain
    steps, but its whole wall time was lost: with the default budget no other bucket probes after it."""
    cfg = StepCostConfig(min_plain=1, probe_steps=3, probe_budget=1.0)
    costs = StepCosts(cfg, ONE_GPU_BUCKETS)
    b = ONE_GPU_BUCKETS.bucket(4)
    costs.observe(4, False, 4, 0.01)
    costs.observe(4, True, 4 * 3, 2.2)  # 220 plain steps long
    for _ in range(3):
        costs.observe(4, True, 4 * 3, 0.011)  # 3 tokens per sequence for 1.1 plain steps
    assert costs.sd_pays(b)
    assert costs.probe_loss_s >= 2.2 - 3 * 0.01

    costs = StepCosts(StepCostConfig(min_plain=1), ONE_GPU_BUCKETS)
    other = ONE_GPU_BUCKETS.bucket(12)
    assert other != b
    for active in (4, 12):
        costs.observe(active, False, active, 0.01)
    assert costs.sd_pays(other)  # nothing lost yet: it may probe
    costs.observe(4, True, 4 * 3, 2.2, first_use=True)
    assert not costs.sd_pays(other)


def test_a_bucket_judged_on_where_sd_is_declined_is_judged_afresh() -> None:
    """Switch-on plain steps (the bandit chose plain decoding) in a row: after decline_limit of them the bucket's
    judgement is dropped; an SD step in between restarts the count; a bucket judged off is left alone."""
    cfg = StepCostConfig(min_plain=1, probe_steps=2, decline_limit=3, probe_budget=0.0)
    costs = StepCosts(cfg, ONE_GPU_BUCKETS)
    b = ONE_GPU_BUCKETS.bucket(4)
    costs.observe(4, False, 4, 0.01)
    for _ in range(2):
        costs.observe(4, True, 4 * 3, 0.011, arm="ngram-c3")  # 3 tokens per sequence for 1.1 plain steps: pays
    assert costs.buckets[b].on is True
    costs.decline(4)
    costs.decline(4)
    costs.observe(4, True, 4 * 3, 0.011, arm="ngram-c3")  # SD played again: the count restarts
    costs.decline(4)
    costs.decline(4)
    assert costs.buckets[b].on is True and costs.sd_pays(b)
    costs.decline(4)
    assert costs.buckets[b].on is None and not costs.buckets[b].arms  # unjudged: probed again within the budget

    costs = StepCosts(cfg, ONE_GPU_BUCKETS)
    costs.observe(4, False, 4, 0.01)
    for _ in range(2):
        costs.observe(4, True, 4, 0.03, arm="ngram-c3")  # 1 token for 3 plain steps: off
    for _ in range(5):
        costs.decline(4)
    assert costs.buckets[b].on is False


def test_the_controller_declines_for_switch_on_plain_steps() -> None:
    """AdaptiveSd.record tells the step costs of each switch-on step its bandit ran plainly."""
    ctl = AdaptiveSd.from_spec(RolloutConfig(speculative="adaptive"), ["ngram"],
                               step_costs=StepCostConfig(decline_limit=2))
    assert ctl.costs is not None
    ctl.costs.buckets[ctl.scheme.bucket(4)] = bucket = BucketCosts(on=True)
    ctl.record(4, NO_SD, 4, 0.01, sd_on=False)  # switch off: not a decline
    ctl.record(4, NO_SD, 4, 0.01, sd_on=True)
    assert bucket.on is True and bucket.declined == 1
    ctl.record(4, NO_SD, 4, 0.01, sd_on=True)
    assert bucket.on is None


def test_engine_rollout_with_the_cost_switch(capsys) -> None:
    """The adaptive engine loop runs with the cost switch (`tlt bench rollout --sd-costs-below`) and reports."""
    import json

    from worker.tlt.bench import main

    args = ["rollout", "--model", "tiny-llama", "--device", "cpu", "--prompts", "3", "--samples", "2",
            "--max-new-tokens", "24", "--sd", "adaptive", "--sd-costs-below", "8", "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["sequences"] == 6 and "sd/on_fraction" in r["sd_metrics"]
    assert sum(b["tokens"] for b in r["buckets"]) + 6 == r["tokens"]  # every decode step was recorded


def test_free_probes_reach_a_verdict_where_the_budget_alone_would_not() -> None:
    """With the budget spent by one probe, a bucket still takes its `free_probes` SD steps, so it is judged (here
    off: 1 token per sequence for 3 plain steps' time) instead of staying unjudged; then the budget rules again."""
    costs = StepCosts(StepCostConfig(min_plain=1, free_probes=4), ONE_GPU_BUCKETS)
    b = ONE_GPU_BUCKETS.bucket(6)
    for _ in range(4):
        costs.observe(6, False, 6, 0.01)
    probes = 0
    while costs.sd_pays(b):  # the budget is spent by the first probe: the rest are the free ones
        costs.observe(6, True, int(6 * 1.1), 0.03)
        probes += 1
        assert probes <= 4
    assert probes == 2  # a clear case (gain 0.2 < decisive 0.5): judged after two
    assert costs.buckets[b].on is False and costs.summary()["sd/pays/5-8"] == 0.0
    assert costs.summary()["sd/step_s_sd/5-8"] == 0.03 and costs.summary()["sd/step_s_plain/5-8"] == 0.01
    other = ONE_GPU_BUCKETS.bucket(3)
    costs.observe(3, False, 3, 0.01)
    no_free = StepCosts(StepCostConfig(min_plain=1), ONE_GPU_BUCKETS)
    no_free.observe(6, False, 6, 0.01)
    no_free.observe(6, True, 6, 0.03)
    assert not no_free.sd_pays(b)  # the default: the budget alone, spent by the first probe
    assert costs.sd_pays(other)  # another bucket's own free probes


def test_a_checkpointed_controller_continues_exactly() -> None:
    """The controller's learned state (bandit, step costs, arms dropped), through a checkpoint's loader
    (weights_only), into a fresh controller: it then plans and learns exactly as the one that kept running."""

    def fresh() -> AdaptiveSd:  # captures=False: nothing to re-capture after a resume, so every step is learned
        table = arms_table(["ngram"], ONE_GPU_BUCKETS)
        switch = SwitchConfig(mode="adaptive", on_below=32, patience=3, off_at=128)
        return AdaptiveSd(switch, make_bandit(table, BanditConfig(), seed=0), scheme=ONE_GPU_BUCKETS,
                          costs=StepCosts(StepCostConfig(), ONE_GPU_BUCKETS), captures=False)

    lengths = response_lengths(64, seed=1)
    kept = fresh()
    rollout(kept, SimEnv({"ngram": 0.6}, WIDE, seed=0), lengths)
    assert kept.costs is not None and any(k.startswith("sd/pays/") for k in kept.costs.summary())  # judged
    buf = io.BytesIO()
    torch.save(kept.state_dict(), buf)
    buf.seek(0)
    resumed = fresh()
    assert resumed.state_dict() != kept.state_dict()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.state_dict() == kept.state_dict()
    assert resumed.costs is not None and resumed.costs.summary() == kept.costs.summary()
    # the next rollout, on the same simulated GPU: the same plans, seconds and SD steps, and the same state after
    assert rollout(resumed, SimEnv({"ngram": 0.6}, WIDE, seed=1), lengths) == \
        rollout(kept, SimEnv({"ngram": 0.6}, WIDE, seed=1), lengths)
    assert resumed.state_dict() == kept.state_dict()
