"""A simulated cost model of one decode step, where the best arm per batch size is known exactly.

Used by the bandit tests and by `python -m bench.bandit_sim` (which compares the policies); it models, it does not
measure. One step of `batch` sequences with an arm costs:

- target verify forward over `batch * arm.verify_tokens` tokens: `target_fixed_s` while memory-bound (weights read once
  per forward), growing linearly past `target_sat_tokens` (compute-bound) -- roofline;
- drafting: a learned drafter runs `depth` sequential forwards over `batch * topk` tokens (same roofline, its own
  constants); the n-gram drafter a host-side lookup (fixed + per sequence); "none" drafts nothing;
- step time is multiplied by log-normal noise (sigma `noise`).

Acceptance: each drafter kind has a per-position acceptance probability alpha (top-1 draft matches the target,
given the prefix did). A tree of width topk with verify width v covers about w = min(topk, (v - 1) / depth)
candidates per level, modelled as alpha_eff = 1 - (1 - alpha) ** sqrt(w) (later candidates are less likely). The accepted length of
a sequence is a geometric run truncated at depth; it emits accepted + 1 tokens (the bonus / recovered token).

`run_bucket` plays one bucket against the oracle (regret); `simulate_rollout` runs a whole rollout (sequences of
log-normal lengths finishing one by one, the SD switch, a bandit, RolloutSdMetrics) against SD off or the oracle.

Run: `python -m bench.bandit_sim` (tables) or the tests in tests/adaptive.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from worker.tlt.speculative.arm import NO_SD, Arm
from worker.tlt.speculative.control.arm_buckets import TLT_BUCKETS, BucketScheme
from worker.tlt.speculative.control.bandit import WindowBandit
from worker.tlt.speculative.control.sd_metrics import RolloutSdMetrics
from worker.tlt.speculative.control.switch import SdSwitch, SwitchConfig


@dataclass(frozen=True)
class SimCostModel:
    target_fixed_s: float = 4e-3  # one target forward while memory-bound (weights + launches), seconds
    target_sat_tokens: int = 256  # tokens per target forward beyond which time grows linearly (compute-bound)
    draft_fixed_s: float = 0.8e-3  # one learned-drafter forward while memory-bound (one layer + the lm_head)
    draft_sat_tokens: int = 512  # drafter forward tokens beyond which it is compute-bound
    ngram_fixed_s: float = 0.3e-3  # host-side suffix lookup per step
    ngram_per_seq_s: float = 0.02e-3  # ... plus this per sequence
    # fixed extra cost of any SD step: an eager (not graph-captured) verify paid 31-46 ms on the H200 where a graphed
    # plain step took 3.8 ms; 0 = the verify is graphed like the plain step
    sd_overhead_s: float = 0.0
    noise: float = 0.05  # log-normal sigma of the step time

    def target_s(self, tokens: int) -> float:
        return self.target_fixed_s * max(1.0, tokens / self.target_sat_tokens)

    def draft_s(self, arm: Arm, batch: int) -> float:
        if arm.drafter == "none":
            return 0.0
        if arm.drafter == "ngram":
            return self.ngram_fixed_s + self.ngram_per_seq_s * batch
        return arm.depth * self.draft_fixed_s * max(1.0, batch * arm.topk / self.draft_sat_tokens)

    def step_s(self, arm: Arm, batch: int) -> float:
        """Mean step time (noise-free)."""
        extra = self.sd_overhead_s if arm.is_sd else 0.0
        return self.target_s(batch * arm.verify_tokens) + self.draft_s(arm, batch) + extra


def effective_alpha(arm: Arm, alpha: float) -> float:
    """Per-level acceptance probability of an arm whose top-1 draft is accepted with probability `alpha`."""
    if arm.chain:
        return alpha
    width = max(1.0, min(arm.topk, arm.num_drafted / arm.depth))
    return 1.0 - (1.0 - alpha) ** math.sqrt(width)


def expected_emitted(arm: Arm, alpha: float) -> float:
    """Mean tokens emitted per sequence per step: 1 + sum_{i=1..depth} alpha_eff^i."""
    a = effective_alpha(arm, alpha) if arm.is_sd else 0.0
    return 1.0 + sum(a**i for i in range(1, arm.depth + 1))


@dataclass
class SimEnv:
    """Draws (tokens, seconds) of steps; `alphas` maps drafter kind -> acceptance and may be changed mid-run."""

    alphas: dict[str, float]  # drafter kind -> per-position acceptance of its top-1 draft
    model: SimCostModel = field(default_factory=SimCostModel)
    seed: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def expected_reward(self, arm: Arm, batch: int) -> float:
        """Mean tokens/s of a step (the quantity the bandits estimate)."""
        return batch * expected_emitted(arm, self.alphas.get(arm.drafter, 0.0)) / self.model.step_s(arm, batch)

    def oracle(self, arms: Sequence[Arm], batch: int) -> Arm:
        return max(arms, key=lambda a: self.expected_reward(a, batch))

    def accepted(self, arm: Arm) -> int:
        """Accepted draft tokens of one sequence (truncated geometric run)."""
        if not arm.is_sd:
            return 0
        a = effective_alpha(arm, self.alphas.get(arm.drafter, 0.0))
        if a <= 0.0:
            return 0
        if a >= 1.0:
            return arm.depth
        return min(arm.depth, int(math.log(1.0 - self.rng.random()) / math.log(a)))

    def step(self, arm: Arm, batch: int) -> tuple[int, float]:
        """One simulated step: (tokens emitted across the batch, wall seconds)."""
        tokens = batch + sum(self.accepted(arm) for _ in range(batch)) if arm.is_sd else batch
        seconds = self.model.step_s(arm, batch) * math.exp(self.rng.gauss(0.0, self.model.noise))
        return tokens, seconds


@dataclass
class SimTrace:
    """What a bandit did over a run: per round the chosen arm, its expected reward and the oracle's."""

    chosen: list[str] = field(default_factory=list)
    best: list[str] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)  # expected tokens/s of the chosen arm
    oracle_reward: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def fraction_best(self, last: int) -> float:
        pairs = list(zip(self.chosen[-last:], self.best[-last:], strict=True))
        return sum(c == b for c, b in pairs) / max(1, len(pairs))

    def regret(self, last: int = 0) -> float:
        """Relative regret over all rounds (or the last `last`): 1 - sum(expected reward of chosen) / sum(oracle's)."""
        return 1.0 - sum(self.reward[-last:]) / max(sum(self.oracle_reward[-last:]), 1e-12)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-12)


def run_bucket(bandit: WindowBandit, env: SimEnv, bucket: int, arms: Sequence[Arm], batches: Sequence[int],
               events: Mapping[int, dict[str, float]] | None = None) -> SimTrace:
    """Play one bucket for len(batches) rounds (round i runs batch batches[i]); `events[i]` updates env.alphas
    before round i (a drafter improving online)."""
    trace = SimTrace()
    for i, batch in enumerate(batches):
        if events and i in events:
            env.alphas.update(events[i])
        arm = bandit.select(bucket)
        tokens, seconds = env.step(arm, batch)
        bandit.observe(bucket, arm, tokens, seconds, active=batch)
        best = env.oracle(arms, batch)
        trace.chosen.append(arm.name)
        trace.best.append(best.name)
        trace.reward.append(env.expected_reward(arm, batch))
        trace.oracle_reward.append(env.expected_reward(best, batch))
        trace.tokens += tokens
        trace.seconds += seconds
    return trace


def response_lengths(n: int, seed: int = 0, median: float = 220.0, sigma: float = 0.6, cap: int = 1024) -> list[int]:
    """Log-normal response lengths capped at `cap`: the long tail of a reasoning rollout (GSM8K-like)."""
    rng = random.Random(seed)
    return [max(1, min(cap, int(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]


def simulate_rollout(env: SimEnv, lengths: Sequence[int], arms: Mapping[int, Sequence[Arm]],
                     policy: WindowBandit | str, switch: SwitchConfig | None = None,
                     scheme: BucketScheme = TLT_BUCKETS) -> RolloutSdMetrics:
    """One rollout: all sequences start together and decode until their own length; the active batch shrinks.

    policy: a bandit (select/observe each SD step), "off" (never SD), or "oracle" (the best arm at each batch size,
    known only to the simulator). Returns the rollout's metrics (seconds are simulated).
    """
    switch_cfg = switch or SwitchConfig(mode="off" if policy == "off" else "adaptive")
    sw = SdSwitch(switch_cfg)
    metrics = RolloutSdMetrics(on_below=switch_cfg.on_below, scheme=scheme)
    remaining = [n for n in lengths if n > 0]
    while remaining:
        active = len(remaining)
        on = sw.update(active)
        bucket = scheme.bucket(active)
        arm = NO_SD
        if on and isinstance(policy, WindowBandit):
            arm = policy.select(bucket)
        elif on and policy == "oracle":
            arm = env.oracle(arms[bucket], active)
        acc = [min(env.accepted(arm), r - 1) for r in remaining]  # EOS / length cuts inside the accepted run
        emitted = active + sum(acc)
        seconds = env.model.step_s(arm, active) * math.exp(env.rng.gauss(0.0, env.model.noise))
        if on and isinstance(policy, WindowBandit):
            policy.observe(bucket, arm, emitted, seconds, active=active)
        metrics.observe_step(active=active, sd_on=on, arm=arm.name if on else None, verify_tokens=arm.verify_tokens,
                             emitted=emitted, seconds=seconds,
                             accepted_per_pos=[sum(a >= k for a in acc) for k in range(1, arm.depth + 1)])
        remaining = [r - 1 - a for r, a in zip(remaining, acc, strict=True) if r - 1 - a > 0]
    return metrics
