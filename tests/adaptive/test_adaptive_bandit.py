"""Per-bucket bandits on the simulated cost model, where the right arm is known.

Run: `python -m pytest tests/adaptive/test_adaptive_bandit.py -q` (a few seconds).
"""

from __future__ import annotations

import json
import random

import pytest

from worker.tlt.speculative.arm import NO_SD, chain_arm
from worker.tlt.speculative.control.arm_buckets import arms_table, default_arms
from worker.tlt.speculative.control.bandit import BANDITS, BanditConfig, bandit_from_dict, make_bandit
from worker.tlt.speculative.control.sim import SimEnv, run_bucket

KINDS = sorted(BANDITS)
# Batches per bucket where one arm is best throughout (checked by test_the_sim_has_a_clear_winner).
BATCHES = {0: (1, 1), 1: (2, 4), 2: (5, 20), 3: (64, 64)}
STRONG = {"ngram": 0.5, "eagle": 0.8}


def batches(bucket: int, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    lo, hi = BATCHES[bucket]
    return [rng.randint(lo, hi) for _ in range(n)]


def test_the_sim_has_a_clear_winner() -> None:
    # the convergence tests below are only meaningful if the oracle's arm beats the runner-up by a margin
    env = SimEnv(dict(STRONG))
    for bucket, arms in arms_table(["ngram", "eagle"]).items():
        lo, hi = BATCHES[bucket]
        winners = {env.oracle(arms, b).name for b in range(lo, hi + 1)}
        assert len(winners) == 1
        for b in (lo, hi):
            rewards = sorted(env.expected_reward(a, b) for a in arms)
            assert rewards[-1] > 1.15 * rewards[-2]


@pytest.mark.parametrize("kind", KINDS)
def test_converges_to_the_best_arm_in_every_bucket(kind: str) -> None:
    table = arms_table(["ngram", "eagle"])
    bandit = make_bandit(table, BanditConfig(kind=kind), seed=1)  # type: ignore[arg-type]
    for bucket, arms in table.items():
        trace = run_bucket(bandit, SimEnv(dict(STRONG), seed=bucket), bucket, arms, batches(bucket, 600))
        # epsilon-greedy explores epsilon * (K-1)/K = 8% of its steps; at batch 1 a step's reward is one sequence's
        # accepted run, noisy enough that UCB/Thompson keep sampling runners-up (seen down to 0.79 over seeds)
        assert trace.fraction_best(200) >= 0.75, (bucket, trace.chosen[-20:])
        assert trace.regret() < 0.15


@pytest.mark.parametrize("kind", KINDS)
def test_useless_drafts_converge_to_no_sd(kind: str) -> None:
    table = arms_table(["ngram", "eagle"])
    bandit = make_bandit(table, BanditConfig(kind=kind), seed=2)  # type: ignore[arg-type]
    for bucket, arms in table.items():
        trace = run_bucket(bandit, SimEnv({"ngram": 0.0, "eagle": 0.0}, seed=bucket), bucket, arms,
                           batches(bucket, 400))
        assert set(trace.best) == {"none"}
        assert trace.fraction_best(200) >= 0.8, (bucket, trace.chosen[-20:])


@pytest.mark.parametrize("kind", KINDS)
def test_adapts_when_the_learned_drafter_improves(kind: str) -> None:
    # the learned drafter gets better mid-run (trained online): the bandit must move to its tree
    bucket = 2
    arms = default_arms(bucket, ["ngram", "eagle"])
    bandit = make_bandit({bucket: arms}, BanditConfig(kind=kind), seed=3)  # type: ignore[arg-type]
    env = SimEnv({"ngram": 0.4, "eagle": 0.1}, seed=7)
    trace = run_bucket(bandit, env, bucket, arms, batches(bucket, 1600), events={600: {"eagle": 0.8}})
    assert trace.best[0].startswith("ngram") and trace.best[-1] == "eagle-d6k4v16"  # the right arm changed
    assert trace.fraction_best(300) >= 0.75, trace.chosen[-30:]
    assert trace.regret(last=300) < 0.08


@pytest.mark.parametrize("kind", KINDS)
def test_adapts_when_the_learned_drafter_degrades(kind: str) -> None:
    # the policy moved and the drafter no longer matches it: the bandit must leave the eagle arms
    bucket = 2
    arms = default_arms(bucket, ["ngram", "eagle"])
    bandit = make_bandit({bucket: arms}, BanditConfig(kind=kind), seed=3)  # type: ignore[arg-type]
    env = SimEnv({"ngram": 0.4, "eagle": 0.8}, seed=7)
    trace = run_bucket(bandit, env, bucket, arms, batches(bucket, 1600), events={600: {"eagle": 0.0}})
    assert trace.best[0].startswith("eagle") and trace.best[-1].startswith("ngram")
    late = trace.chosen[-300:]
    assert sum(c.startswith("eagle") for c in late) / len(late) < 0.12  # epsilon-greedy explores 3/6 * 0.1
    assert trace.regret(last=300) < 0.08  # ngram-c3 and ngram-c6 are within ~2%: either is right


@pytest.mark.parametrize("kind", KINDS)
def test_forced_exploration_measures_every_arm_first(kind: str) -> None:
    arms = default_arms(0, ["ngram", "eagle"])
    cfg = BanditConfig(kind=kind, min_pulls=2, loss_budget=None)  # type: ignore[arg-type]  # the order alone
    bandit = make_bandit({0: arms}, cfg, seed=0)
    env = SimEnv(dict(STRONG))
    first = []
    for _ in range(2 * len(arms)):
        arm = bandit.select(0)
        first.append(arm.name)
        bandit.observe(0, arm, *env.step(arm, 1))
    assert first[0] == "none"
    assert all(first.count(a.name) == 2 for a in arms)


@pytest.mark.parametrize("kind", KINDS)
def test_seeded_and_resumable_from_a_checkpoint(kind: str) -> None:
    table = arms_table(["ngram", "eagle"])
    cfg = BanditConfig(kind=kind)  # type: ignore[arg-type]

    def play(bandit, env, n: int) -> list[str]:
        out: list[str] = []
        for b in batches(2, n, seed=len(out)):
            arm = bandit.select(2)
            bandit.observe(2, arm, *env.step(arm, b))
            out.append(arm.name)
        return out

    a, b = make_bandit(table, cfg, seed=5), make_bandit(table, cfg, seed=5)
    env_a, env_b = SimEnv(dict(STRONG), seed=1), SimEnv(dict(STRONG), seed=1)
    assert play(a, env_a, 150) == play(b, env_b, 150)  # same seed, same choices
    restored = bandit_from_dict(json.loads(json.dumps(a.to_dict())))  # through JSON, as a checkpoint would
    assert type(restored) is type(a) and restored.config == a.config
    assert play(restored, SimEnv(dict(STRONG), seed=9), 200) == play(a, SimEnv(dict(STRONG), seed=9), 200)
    assert len(json.dumps(a.to_dict())) < 60_000  # small state


def test_buckets_are_independent_and_arms_can_change_online() -> None:
    bandit = make_bandit({0: [NO_SD, chain_arm("ngram", 3)], 1: [NO_SD]}, BanditConfig(), seed=0)
    for _ in range(5):
        bandit.observe(0, NO_SD, 10, 1.0)
    assert bandit.stats(1)[0]["n"] == 0 and bandit.stats(0)[0]["n"] == 5
    eagle = chain_arm("eagle", 3)
    bandit.set_arms(0, [NO_SD, chain_arm("ngram", 3), eagle])  # the learned drafter became available
    assert bandit.stats(0)[0]["n"] == 5  # kept
    assert bandit.select(0).name == "ngram-c3"  # unmeasured arms first, in table order
    bandit.observe(0, chain_arm("ngram", 3), 30, 1.0)
    bandit.observe(0, chain_arm("ngram", 3), 30, 1.0)
    assert bandit.select(0) == eagle
    with pytest.raises(KeyError):
        bandit.select(7)
    with pytest.raises(ValueError):
        bandit.observe(0, NO_SD, 10, 0.0)


def test_observations_expire_so_a_stale_arm_is_measured_again() -> None:
    fast, slow = chain_arm("ngram", 3), NO_SD
    bandit = make_bandit({0: [slow, fast]}, BanditConfig(kind="ucb", max_age=50, window=8, min_pulls=2), seed=0)
    for _ in range(2):
        bandit.observe(0, slow, 1, 1.0)
    for _ in range(60):  # 60 rounds of only the fast arm: slow's two observations age out
        bandit.observe(0, fast, 100, 1.0)
    assert bandit.stats(0)[0]["n"] == 0
    assert bandit.select(0) == slow


@pytest.mark.parametrize("kind", KINDS)
def test_a_rarely_visited_bucket_borrows_its_neighbours_measurements(kind: str) -> None:
    # bucket 1 (2-4 active) was measured for a while; bucket 0 (batch 1) then appears for a few steps only
    table = arms_table(["ngram", "eagle"])
    env = SimEnv({"ngram": 0.0, "eagle": 0.0}, seed=0)  # useless drafts: every step off "none" is a loss
    # loss_budget=None: borrowing alone is measured here (the loss budget would also hold the SD arms back)
    shared = make_bandit(table, BanditConfig(kind=kind, loss_budget=None), seed=0)  # type: ignore[arg-type]
    alone = make_bandit(table, BanditConfig(kind=kind, share_rounds=0, loss_budget=None), seed=0)  # type: ignore[arg-type]
    for bandit in (shared, alone):
        run_bucket(bandit, env, 1, table[1], batches(1, 300))
    few = {b: run_bucket(b, env, 0, table[0], [1] * 20) for b in (shared, alone)}
    # every arm of bucket 0 has a same-shape arm measured in bucket 1 (the tree with its smaller verify budget):
    # nothing is forced, and "none" is played from the first step on (but for epsilon-greedy's exploration)
    assert few[shared].chosen[0] == "none" and few[shared].chosen.count("none") >= 15
    assert few[alone].chosen[:12] == [a.name for a in table[0] for _ in range(2)]  # table order, min_pulls=2
    assert few[shared].regret() < 0.5 * few[alone].regret()


def test_borrowing_ends_so_a_misleading_neighbour_cannot_lock_an_arm_out() -> None:
    # bucket 1 saw the ngram arm as useless; in bucket 0 it is the best arm: after share_rounds it gets measured there
    arms = [NO_SD, chain_arm("ngram", 3)]
    bandit = make_bandit({0: arms, 1: arms}, BanditConfig(kind="thompson", share_rounds=30), seed=0)
    for _ in range(20):
        bandit.observe(1, NO_SD, 4, 1.0, active=4)
        bandit.observe(1, arms[1], 2, 1.0, active=4)
    picks = []
    for _ in range(60):
        arm = bandit.select(0)
        picks.append(arm.name)
        bandit.observe(0, arm, 3 if arm.is_sd else 1, 1.0, active=1)  # ngram emits 3x the tokens at batch 1
    assert "ngram-c3" not in picks[:30]  # trusted the neighbour while the bucket was new
    assert picks[-10:].count("ngram-c3") >= 8  # then measured it locally and switched


def test_an_sd_step_after_plain_steps_that_emitted_nothing_is_observed() -> None:
    # plain decoding measured at 0 tokens/s (every row finished): there is no plain-time estimate for the SD step,
    # its reward is still recorded and no loss is charged
    sd = chain_arm("ngram", 3)
    bandit = make_bandit({0: [NO_SD, sd]}, BanditConfig(kind="ucb", min_pulls=1), seed=0)
    bandit.observe(0, NO_SD, 0, 0.5, active=1)
    bandit.observe(0, sd, 4, 0.5, active=1)
    assert [s["n"] for s in bandit.stats(0)] == [1, 1]
    assert bandit.step_loss is None
