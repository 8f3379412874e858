"""RolloutSdMetrics: the sd/* and perf/tokens_per_s_* names of a rollout.

Run: `python -m pytest tests/adaptive/test_adaptive_metrics.py -q`.
"""

from __future__ import annotations

import pytest

from worker.tlt.rl.engine_adapter import sd_metrics
from worker.tlt.rollout.types import GenerationOutput, StepStats
from worker.tlt.speculative.control.sd_metrics import RolloutSdMetrics, per_position_counts
from worker.tlt.speculative.control.switch import SdSwitch, SwitchConfig


def test_per_position_counts() -> None:
    # three sequences drafted 3, 3 and 1 tokens; accepted 2, 0, 1
    acc, drafted = per_position_counts([2, 0, 1], [3, 3, 1])
    assert acc == [2, 1, 0] and drafted == [3, 2, 2]
    with pytest.raises(ValueError):
        per_position_counts([2], [1])


def test_summary_of_a_small_rollout() -> None:
    m = RolloutSdMetrics(on_below=4)
    # full batch, SD off: 8 sequences, 8 tokens in 0.1 s
    m.observe_step(active=8, sd_on=False, arm=None, verify_tokens=1, emitted=8, seconds=0.1)
    # tail, SD on with a 3-chain: 2 sequences accept 2 and 0 tokens -> emit 3 + 1
    m.observe_step(active=2, sd_on=True, arm="ngram-c3", verify_tokens=4, emitted=4, seconds=0.02,
                   accepted_per_pos=[1, 1, 0])
    # tail, SD on but the bandit chose plain decoding
    m.observe_step(active=2, sd_on=True, arm="none", verify_tokens=1, emitted=2, seconds=0.01)
    # tail, 1 sequence, all 3 accepted -> 4 emitted
    m.observe_step(active=1, sd_on=True, arm="ngram-c3", verify_tokens=4, emitted=4, seconds=0.01,
                   accepted_per_pos=[1, 1, 1])
    s = m.summary()
    assert s["sd/on_fraction"] == pytest.approx(3 / 4)
    assert s["sd/spec_step_fraction"] == pytest.approx(2 / 4)  # the "none" step had the switch on but did not draft
    # drafting sequence-steps: 2 + 1 = 3; accepted 2 + 0 + 3 = 5 -> 1 + 5/3
    assert s["sd/accept_len"] == pytest.approx(1 + 5 / 3)
    assert s["sd/verify_tokens"] == pytest.approx(4.0)
    assert s["sd/accept_rate_pos_1"] == pytest.approx(2 / 3)
    assert s["sd/accept_rate_pos_2"] == pytest.approx(2 / 3)
    assert s["sd/accept_rate_pos_3"] == pytest.approx(1 / 3)
    assert "sd/accept_rate_pos_4" not in s
    assert s["sd/arm/ngram-c3"] == 2 and s["sd/arm/none"] == 1
    assert s["perf/tokens_per_s_full"] == pytest.approx(80.0)
    assert s["perf/tokens_per_s_tail"] == pytest.approx(10 / 0.04)
    # the tail per mode, per sequence: drafting steps 8 tokens over 2 x 0.02 + 1 x 0.01, the plain one 2 over 2 x 0.01
    assert s["perf/seq_tokens_per_s_tail_sd"] == pytest.approx(8 / 0.05)
    assert s["perf/seq_tokens_per_s_tail_plain"] == pytest.approx(2 / 0.02)
    assert "perf/tokens_per_s_bucket/ge21" not in s
    assert s["perf/tokens_per_s_bucket/5-20"] == pytest.approx(80.0)
    assert s["perf/tokens_per_s_bucket/2-4"] == pytest.approx(6 / 0.03)
    assert s["perf/tokens_per_s_bucket/1"] == pytest.approx(4 / 0.01)
    rows = {r["bucket"]: r for r in m.per_bucket()}
    assert rows["2-4"]["steps"] == 2 and rows["2-4"]["sd_on_steps"] == 2 and rows["5-20"]["sd_on_steps"] == 0
    # per bucket, for the "adaptive vs SD off" table: tokens/s and what the bandit played there
    assert rows["2-4"]["arms"] == {"ngram-c3": 1, "none": 1} and rows["5-20"]["arms"] == {}
    assert rows["2-4"]["tokens_per_s"] == pytest.approx(6 / 0.03) and rows["1"]["arms"] == {"ngram-c3": 1}
    # one sequence's rate: tokens over active x seconds (2-4: 6 tokens over 2 x 0.02 + 2 x 0.01 sequence-seconds)
    assert rows["2-4"]["seq_tokens_per_s"] == pytest.approx(6 / 0.06)
    assert s["perf/seq_tokens_per_s_bucket/5-20"] == pytest.approx(8 / 0.8)


def test_per_sequence_rate_does_not_depend_on_the_batch_mix() -> None:
    """Two runs at the same step time per batch size, one spending its bucket's steps at larger batches: tokens/s
    differs, the per-sequence rate does not."""
    fuller, emptier = RolloutSdMetrics(), RolloutSdMetrics()
    for active in (20, 20, 20, 6):
        fuller.observe_step(active=active, sd_on=False, arm=None, verify_tokens=1, emitted=active, seconds=0.002)
    for active in (6, 6, 6, 20):
        emptier.observe_step(active=active, sd_on=False, arm=None, verify_tokens=1, emitted=active, seconds=0.002)
    a, b = fuller.per_bucket()[0], emptier.per_bucket()[0]
    assert a["bucket"] == b["bucket"] == "5-20"
    assert a["tokens_per_s"] == pytest.approx(66 / 0.008) and b["tokens_per_s"] == pytest.approx(38 / 0.008)
    assert a["seq_tokens_per_s"] == pytest.approx(b["seq_tokens_per_s"]) == pytest.approx(500.0)


def test_drafted_counts_shorter_than_active() -> None:
    # an n-gram drafter found a match for one of two sequences only: position rates use drafted counts
    m = RolloutSdMetrics()
    m.observe_step(active=2, sd_on=True, arm="ngram-c3", verify_tokens=4, emitted=3, seconds=0.01,
                   accepted_per_pos=[1, 0, 0], drafted_per_pos=[1, 1, 1])
    s = m.summary()
    assert s["sd/accept_rate_pos_1"] == 1.0 and s["sd/accept_rate_pos_2"] == 0.0
    assert s["sd/accept_len"] == pytest.approx(1.5)


def test_total_accepted_only() -> None:
    # an engine that counts only the batch total still gets sd/accept_len (no per-position rates)
    m = RolloutSdMetrics()
    m.observe_step(active=4, sd_on=True, arm="eagle-c3", verify_tokens=4, emitted=10, seconds=0.01, accepted=6)
    s = m.summary()
    assert s["sd/accept_len"] == pytest.approx(2.5) and "sd/accept_rate_pos_1" not in s
    with pytest.raises(ValueError):
        m.observe_step(active=2, sd_on=True, arm="x", verify_tokens=4, emitted=3, seconds=0.1,
                       accepted_per_pos=[1, 0, 0], accepted=2)


def test_empty_and_off_only_rollouts_leave_undefined_metrics_out() -> None:
    assert RolloutSdMetrics().summary() == {}
    m = RolloutSdMetrics()
    m.observe_step(active=64, sd_on=False, arm=None, verify_tokens=1, emitted=64, seconds=0.5)
    s = m.summary()
    assert s["sd/on_fraction"] == 0.0 and "sd/accept_len" not in s and "perf/tokens_per_s_tail" not in s
    assert s["sd/spec_step_fraction"] == 0.0 and "perf/seq_tokens_per_s_tail_sd" not in s


def test_rejects_inconsistent_steps() -> None:
    m = RolloutSdMetrics()
    with pytest.raises(ValueError):
        m.observe_step(active=2, sd_on=True, arm="x", verify_tokens=4, emitted=3, seconds=0.0)
    with pytest.raises(ValueError):
        m.observe_step(active=2, sd_on=True, arm="x", verify_tokens=4, emitted=3, seconds=0.1,
                       accepted_per_pos=[3, 0, 0])  # more accepted than active


def test_switch_and_metrics_over_a_shrinking_batch() -> None:
    # the engine's loop in miniature: 40 sequences finish one per step; SD comes on 3 steps after active < 32
    sw, m = SdSwitch(SwitchConfig(on_below=32, patience=3)), RolloutSdMetrics(on_below=32)
    for active in range(40, 0, -1):
        on = sw.update(active)
        m.observe_step(active=active, sd_on=on, arm="ngram-c3" if on else None, verify_tokens=4 if on else 1,
                       emitted=active * (2 if on else 1), seconds=0.01, accepted_per_pos=[active, 0, 0] if on else ())
    s = m.summary()
    assert m.sd_on_steps == 29  # active 29..1: steps with 31 and 30 active were the patience
    assert s["sd/on_fraction"] == pytest.approx(29 / 40)
    assert s["sd/accept_rate_pos_1"] == 1.0 and s["sd/accept_rate_pos_2"] == 0.0
    assert s["sd/accept_len"] == pytest.approx(2.0)


def test_sd_metrics_without_the_adaptive_controller_say_where_sd_ran() -> None:
    # speculative: "on" (no controller): the share of tokens from speculative steps, and of decode steps that drafted
    steps = [StepStats("prefill", 4, 4, 1, 4, 0, 0.1), StepStats("decode", 4, 4, 1, 4, 0, 0.01),
             StepStats("spec", 2, 2, 4, 6, 4, 0.02), StepStats("decode", 1, 1, 1, 1, 0, 0.01)]
    m = sd_metrics(GenerationOutput(sequences=[], steps=steps, seconds=0.14))
    assert m["sd/spec_step_fraction"] == pytest.approx(1 / 3)
    assert m["sd/on_fraction"] == pytest.approx(6 / 11)
