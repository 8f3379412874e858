"""SD on/off from measured step costs: per batch bucket, plain decoding's seconds per step against a speculative step's
seconds and tokens emitted per sequence, instead of a fixed active-batch threshold.

Speculative decoding pays in a bucket when a sequence gains more tokens per second from SD steps than from plain
ones: emitted_per_seq(SD) / seconds(SD step) > 1 / seconds(plain step). On a launch-bound 135M model the SD step
costs several plain steps and never pays; on a memory-bound 7B-class target a verify of a few tokens per row costs
about one plain step, so it pays wherever drafts are accepted, well above TLT's fixed 32 active sequences.

    costs = StepCosts(StepCostConfig(), scheme)          # kept across rollouts, as the bandit's state
    ctl = AdaptiveSd(switch_cfg, bandit, scheme=scheme, costs=costs)   # the controller switches by it (CostSwitch)
    costs.observe(active, is_sd, emitted, seconds)       # the controller's record() feeds every step
    costs.prime(bucket, plain_s=..., sd_s=..., best_emitted=...)  # optional: costs measured at warm-up
    costs.state_dict() / costs.load_state_dict(state)   # checkpointed with the controller (rl/checkpoint.py)

A bucket is judged once it holds `min_plain` plain and `probe_steps` SD steps (2 in a clear case): on when its best
SD arm's tokens/s per sequence beats plain's by `margin` (each arm's steps are kept apart: the bandit picks the arm),
and it stays on until that falls below plain (hysteresis). `cannot_pay` names an arm whose steps cost more than
plain decoding could emit at its full acceptance; the controller then drops that arm shape. An
unjudged bucket follows a judged neighbour where the ordering decides (SD's gain falls as the batch grows), else
probes SD only while the time lost to probing stays under `probe_budget` of all observed time (plus one step), so a
model where SD cannot pay loses at most about that fraction. A bucket judged on where the bandit keeps choosing plain
decoding (`decline`) is judged afresh. A bucket judged off is probed again after `reprobe_every` plain steps
there (the learned drafter improves during training). Costs measured at warm-up (`prime`) rule SD out of buckets
where even a fully accepted draft could not pay, with no probing at all.

Run the tests: `python -m pytest tests/adaptive/test_step_costs.py -q`.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from worker.tlt.speculative.control.arm_buckets import BucketScheme
from worker.tlt.speculative.control.switch import SdSwitch, SwitchConfig


@dataclass(frozen=True)
class StepCostConfig:
    min_plain: int = 4  # plain steps measured in a bucket before SD is tried there
    probe_steps: int = 4  # SD steps measured in a bucket before it is judged ...
    decisive: float = 0.5  # ... or 2 steps when SD's gain is below this (or above its inverse): a clear case
    margin: float = 0.05  # SD turns on when its tokens/s per sequence beats plain's by this fraction
    probe_budget: float = 0.01  # probing may lose at most this fraction of the observed time (plus one step) ...
    # ... after a bucket's first `free_probes` SD steps, which it may always take: enough for a verdict where a probe
    # costs a few plain steps (CPU, where nothing compiles), so a short job judges SD instead of leaving it unjudged
    free_probes: int = 0
    reprobe_every: int = 2048  # plain steps in an off bucket after which it is probed again
    # plain steps in a row that a bucket judged on may run with the switch on (the bandit choosing plain decoding)
    # before it is judged afresh: the switch stays on only where SD is still played
    decline_limit: int = 64
    ema: float = 0.1  # weight of a new step in the running mean of tokens emitted per SD step
    # plain steps whose median is a bucket's plain step cost: a median, as for SD arms, so the first steps of a
    # process (allocations, lazy initialisation: 1 s next to 60 ms on CPU) do not make plain decoding look dear
    plain_window: int = 9
    # an SD step counts at most this many plain steps: one that needs longer cannot pay at any accept length, and a
    # first use that compiles or captures (2.2 s next to 10 ms plain steps on an H200) must not poison the means
    outlier: float = 8.0


@dataclass
class ArmCosts:
    """One SD arm's measured steps in a bucket."""

    # seconds of its last steps; their median is its step cost (one slow step moves a mean, not a median)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=5))
    emitted: float = 0.0  # tokens emitted per sequence per step
    n: int = 0

    @property
    def step_s(self) -> float:
        """Seconds per step: the median of the last ones."""
        return statistics.median(self.recent)

    def gain(self, plain_s: float) -> float:
        """Its tokens/s per sequence over plain decoding's."""
        return self.emitted * plain_s / self.step_s


@dataclass
class BucketCosts:
    """Running means of one bucket. SD is judged by its best arm: the bandit that picks the arm learns which one
    that is, so arms that cannot pay (a slow tree at a large width, a weak chain) must not hide one that does."""

    plain_recent: deque[float] = field(default_factory=lambda: deque(maxlen=StepCostConfig.plain_window))
    plain_n: int = 0
    arms: dict[str, ArmCosts] = field(default_factory=dict)  # by arm name, since the last (re)probe started
    sd_n: int = 0  # SD steps since the last (re)probe started, all arms
    probes: int = 0  # SD steps while unjudged, first uses included (against StepCostConfig.free_probes)
    on: bool | None = None  # None: not judged yet
    plain_since_judged: int = 0
    declined: int = 0  # plain steps in a row run with the switch on while judged on (`StepCosts.decline`)
    ruled_out: bool = False  # warm-up costs say no draft can pay here

    @property
    def plain_s(self) -> float:
        """Seconds per plain step: the median of the last ones (a sliding window: costs drift with context length)."""
        return statistics.median(self.plain_recent) if self.plain_recent else 0.0

    def best_arm(self) -> ArmCosts | None:
        """The arm whose tokens/s per sequence beats plain's most (None until plain and an SD step are measured)."""
        if self.plain_n == 0 or self.sd_n == 0:
            return None
        plain_s = self.plain_s
        return max(self.arms.values(), key=lambda a: a.gain(plain_s))

    def gain(self) -> float | None:
        """The best arm's SD tokens/s per sequence over plain's (None until plain and an SD step are measured). A
        lucky step can turn a bucket on; its arm's running mean turns it off again (hysteresis in `observe`)."""
        best = self.best_arm()
        return None if best is None else best.gain(self.plain_s)


def _mean(old: float, new: float, n: int, ema: float) -> float:
    """Plain average over the first samples, then an exponential moving average (costs drift with context length)."""
    w = max(1.0 / n, ema)
    return old + w * (new - old)


@dataclass
class StepCosts:
    config: StepCostConfig = field(default_factory=StepCostConfig)
    scheme: BucketScheme = field(default_factory=BucketScheme)
    buckets: dict[int, BucketCosts] = field(default_factory=dict)
    observed_s: float = 0.0  # all step seconds seen
    probe_loss_s: float = 0.0  # seconds probing SD steps cost beyond plain steps for the same tokens

    def _b(self, bucket: int) -> BucketCosts:
        if bucket not in self.buckets:
            self.buckets[bucket] = BucketCosts(plain_recent=deque(maxlen=self.config.plain_window))
        return self.buckets[bucket]

    def prime(self, bucket: int, plain_s: float, sd_s: float, best_emitted: float) -> None:
        """Warm-up measurement: plain and SD step seconds of this bucket, and the most tokens per sequence an SD step
        can emit (the verify width). A bucket where even that cannot pay is ruled out."""
        b = self._b(bucket)
        b.plain_recent.append(plain_s)
        b.plain_n = max(b.plain_n, 1)
        b.ruled_out = best_emitted * plain_s <= sd_s * (1.0 + self.config.margin)

    def observe(self, active: int, is_sd: bool, emitted: int, seconds: float, first_use: bool = False,
                arm: str = "sd") -> None:
        """One step of `active` sequences: SD (with the arm named `arm`) or plain, tokens emitted (all sequences),
        wall seconds. `first_use`: an SD arm's first step in this bucket (it captured graphs): charged to the probing
        budget, not measured."""
        cfg, b = self.config, self._b(self.scheme.bucket(active))
        self.observed_s += seconds
        if not is_sd:
            b.plain_n += 1
            b.plain_recent.append(seconds)
            if b.on is False:
                b.plain_since_judged += 1
                if b.plain_since_judged >= cfg.reprobe_every:  # drafts may have improved: measure SD afresh
                    b.on, b.sd_n, b.probes, b.plain_since_judged = None, 0, 0, 0
                    b.arms.clear()
            return
        per_seq = emitted / max(active, 1)
        if b.on is None and b.plain_n:  # the whole wall time: a first use that compiles is lost all the same
            self.probe_loss_s += max(0.0, seconds - per_seq * b.plain_s)
            b.probes += 1
        if b.plain_n:
            seconds = min(seconds, cfg.outlier * b.plain_s)
        b.declined = 0
        if first_use:
            return
        b.sd_n += 1
        a = b.arms.setdefault(arm, ArmCosts())
        a.n += 1
        a.recent.append(seconds)
        a.emitted = _mean(a.emitted, per_seq, a.n, cfg.ema)
        gain = b.gain()
        if gain is None:
            return
        clear = b.sd_n >= 2 and (gain < cfg.decisive or gain > 1.0 / cfg.decisive)
        if b.on is None and (b.sd_n >= cfg.probe_steps or clear):
            b.on, b.plain_since_judged = gain > 1.0 + cfg.margin, 0
        elif b.on and gain < 1.0:
            b.on = False

    def decline(self, active: int) -> None:
        """A plain step planned with the switch on (the controller's bandit chose plain decoding). After
        `decline_limit` of them in a row a bucket judged on is judged afresh: its SD arms' means are stale (a lucky
        probe, or a drafter the bandit stopped playing), and a switch left on would bill the tail hook for nothing."""
        b = self._b(self.scheme.bucket(active))
        if not b.on:
            return
        b.declined += 1
        if b.declined >= self.config.decline_limit:
            b.on, b.sd_n, b.probes, b.declined, b.plain_since_judged = None, 0, 0, 0, 0
            b.arms.clear()

    def free_probe(self, bucket: int) -> bool:
        """Whether this bucket's next switch-on step is one of its `free_probes`: it should then measure an SD arm
        (plain decoding chosen there would leave the bucket unjudged)."""
        cfg, b = self.config, self._b(bucket)
        return b.on is None and not b.ruled_out and b.plain_n >= cfg.min_plain and b.probes < cfg.free_probes

    def probed(self, bucket: int, arm: str) -> int:
        """SD steps of the arm named `arm` measured in this bucket since its last (re)probe."""
        a = self._b(bucket).arms.get(arm)
        return a.n if a is not None else 0

    def cannot_pay(self, active: int, arm: str, most_tokens: int) -> bool:
        """Whether the arm named `arm`, whose steps emit at most `most_tokens` per sequence, measured its steps
        (median, two at least: one step can hit a pause) as long as that many plain steps in this bucket: then no
        acceptance can make it pay."""
        b = self._b(self.scheme.bucket(active))
        a = b.arms.get(arm)
        return (a is not None and a.n >= 2 and b.plain_n > 0
                and a.step_s >= most_tokens * b.plain_s)

    def sd_pays(self, bucket: int) -> bool:
        """Whether this bucket's next step should be speculative (judged on, or a probe the budget allows)."""
        cfg, b = self.config, self._b(bucket)
        if b.ruled_out or b.plain_n < cfg.min_plain:
            return False
        if b.on is not None:
            return b.on
        # SD's gain falls as the batch grows (a verify of more rows is less memory-bound; acceptance does not depend
        # on the batch): a smaller bucket judged off rules this one out, a larger one judged on rules it in
        judged = [(i, o.on) for i, o in self.buckets.items() if o.on is not None]
        if any(i < bucket and not on for i, on in judged):
            return False
        if any(i > bucket and on for i, on in judged):
            return True
        if b.probes < cfg.free_probes:
            return True
        return self.probe_loss_s <= cfg.probe_budget * self.observed_s

    def state_dict(self) -> dict:
        """What the costs learned, as plain values (checkpoints load with weights_only): the running costs of every
        bucket and the probing account. The config and bucket scheme come from the spec again."""
        return {
            "observed_s": self.observed_s,
            "probe_loss_s": self.probe_loss_s,
            "buckets": {
                str(i): {
                    "plain_recent": list(b.plain_recent), "plain_n": b.plain_n, "sd_n": b.sd_n, "probes": b.probes,
                    "on": b.on, "plain_since_judged": b.plain_since_judged, "declined": b.declined,
                    "ruled_out": b.ruled_out,
                    "arms": {name: {"recent": list(a.recent), "emitted": a.emitted, "n": a.n}
                             for name, a in b.arms.items()},
                }
                for i, b in self.buckets.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()`'s costs, in place (the switch and the metrics hold this object)."""
        self.observed_s, self.probe_loss_s = float(state["observed_s"]), float(state["probe_loss_s"])
        self.buckets.clear()
        for i, st in state["buckets"].items():
            b = self._b(int(i))
            b.plain_recent.extend(float(x) for x in st["plain_recent"])
            b.plain_n, b.sd_n, b.probes = int(st["plain_n"]), int(st["sd_n"]), int(st["probes"])
            b.on = None if st["on"] is None else bool(st["on"])
            b.plain_since_judged, b.declined = int(st["plain_since_judged"]), int(st["declined"])
            b.ruled_out = bool(st["ruled_out"])
            for name, a in st["arms"].items():
                arm = b.arms.setdefault(name, ArmCosts())
                arm.recent.extend(float(x) for x in a["recent"])
                arm.emitted, arm.n = float(a["emitted"]), int(a["n"])

    def summary(self) -> dict[str, float]:
        """Per bucket: sd/gain/<label> (SD tokens/s per sequence over plain's), sd/pays/<label> (1 on, 0 off), and
        the costs behind them: sd/step_s_plain/<label> and sd/step_s_sd/<label> (the best arm's step seconds)."""
        out: dict[str, float] = {}
        for i, b in sorted(self.buckets.items()):
            label = self.scheme.label(i)
            if b.plain_n:
                out[f"sd/step_s_plain/{label}"] = b.plain_s
            if (best := b.best_arm()) is not None:
                out[f"sd/gain/{label}"] = best.gain(b.plain_s)
                out[f"sd/step_s_sd/{label}"] = best.step_s
            if b.on is not None:
                out[f"sd/pays/{label}"] = float(b.on)
        return out


class CostSwitch(SdSwitch):
    """The controller's switch driven by `StepCosts` instead of the active-batch threshold; SD is never considered
    at or above `config.off_threshold` active sequences (the warm-ups capture verify graphs up to there).
    `config.on_below` keeps its other meaning: the tail of the metrics."""

    def __init__(self, config: SwitchConfig, costs: StepCosts) -> None:
        super().__init__(config)
        self.costs = costs

    def update(self, active: int) -> bool:
        if self.config.mode != "adaptive":
            return self.on
        on = active < self.config.off_threshold and self.costs.sd_pays(self.costs.scheme.bucket(active))
        if on != self._on:
            self._on, self.flips = on, self.flips + 1
        return on
