"""Per-bucket bandits that pick the speculative-decoding arm of each decode step.

One independent bandit per batch-size bucket (see arm_buckets.py). Reward of a step = tokens emitted across the batch /
step wall time (emitted tokens per second), observed by the engine after the step; by default divided by the active
batch (`BanditConfig.per_sequence`: a bucket spans batch sizes, and per sequence the reward no longer depends on
which batch size an arm happened to run at; measured lower regret for all three policies). Three policies share
one interface, `select(bucket) -> Arm` and `observe(bucket, arm, tokens, seconds, active=None)`:

- `EpsilonGreedyMedian` ("epsilon_greedy"): TLT's BEG-MAB. With probability epsilon a uniformly random arm,
  otherwise the arm with the highest *median* reward in its sliding window (robust to outlier steps).
- `SlidingUcb` ("ucb"): UCB1 (Auer et al. 2002) on rewards normalised by the largest fresh reward of the bucket,
  over sliding windows (as SW-UCB, Garivier & Moulines 2011): mean + c * sqrt(2 ln n / n_i).
- `GaussianThompson` ("thompson"): Thompson sampling with a Gaussian on each arm's window mean, normalised as UCB:
  sample mean_i + z * max(std_i, prior_std) / sqrt(n_i), pick the largest sample.

Shared by all three: forced initial exploration (an arm with fewer than `min_pulls` fresh observations is played
first, in table order, so "none" is measured first; with per-sequence rewards, during a bucket's first
`share_rounds` rounds an arm measured in the nearest other bucket borrows that window instead, so a rarely visited
bucket does not spend its few steps exploring); non-stationarity handled by a per-arm window of the last
`window` observations plus expiry after `max_age` rounds of the bucket (an arm unplayed that long is measured
again, because the learned drafter improves online and the policy moves under it); every random draw comes from
one `random.Random(seed)`. State is a small dict (`to_dict` / `bandit_from_dict`) for checkpoints.

Conservative exploration (as conservative bandits, Wu et al. 2016: never fall far behind the baseline arm): each
bucket keeps the plain-decoding time its steps would have taken (`base_s`: a NO_SD step's own seconds; an SD step's
tokens at the bucket's measured NO_SD rate) and the time SD steps lost against that (`loss_s`, negative when SD
won). An SD arm is played only while `loss_s + expected loss of one SD step <= loss_budget * base_s` (the expected
step loss: a running mean of this bucket's SD steps, else of every bucket's, else 0); otherwise the step runs NO_SD.
So a bucket whose drafts are useless runs at most `loss_budget` (3%) slower than SD off, plus at most one step's
misprediction, however expensive an SD step is (eager verify, an n-gram index catching up), while a drafter that
wins (negative loss) earns its own exploration.

Run the tests: `python -m pytest tests/adaptive/test_adaptive_bandit.py -q`; compare the policies on the
simulated cost model: `python -m bench.bandit_sim`.
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

from worker.tlt.speculative.arm import Arm

log = logging.getLogger(__name__)

BanditKind = Literal["epsilon_greedy", "ucb", "thompson"]


@dataclass(frozen=True)
class BanditConfig:
    kind: BanditKind = "thompson"  # lowest regret on the simulated cost model (bench/results/bandit_sim.md)
    window: int = 16  # observations kept per arm (sliding window)
    max_age: int = 500  # an observation expires after this many rounds of its bucket; 0 = never
    min_pulls: int = 2  # forced exploration: fresh observations an arm needs before the policy ranks it
    epsilon: float = 0.1  # epsilon_greedy: exploration probability (TLT: 0.1)
    ucb_c: float = 0.25  # ucb: exploration coefficient on normalised reward (1.0 = textbook UCB1; 0.25 measured best)
    prior_std: float = 0.05  # thompson: floor of a window's std, in units of the bucket's best reward
    # Reward per active sequence (tokens/s / active) when observe() is given `active`. Same ranking of arms at one
    # batch size, but a bucket spans batch sizes (5-20: 4x in tokens/s while memory-bound), and raw tokens/s would
    # credit an arm for the batch it happened to run at; per sequence is nearly flat in the memory-bound tail.
    per_sequence: bool = True
    # During a bucket's first `share_rounds` rounds, an arm with fewer than min_pulls fresh observations there
    # borrows the window of the same arm (drafter, depth, top-k) from the nearest bucket that has them instead of
    # being forced (per-sequence rewards only: those are comparable across buckets). A rarely visited bucket
    # (batch 1 shows up for a few steps per rollout) would otherwise spend its steps exploring; after share_rounds
    # its unmeasured arms are measured locally, so a neighbour's misleading estimate cannot lock an arm out. 0 = off.
    share_rounds: int = 100
    # Conservative exploration (module docstring): SD steps may lose at most this fraction of the bucket's
    # plain-decoding time against NO_SD; None = no limit (the policy alone decides).
    loss_budget: float | None = 0.03

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_pulls < 1 or self.min_pulls > self.window or self.max_age < 0:
            raise ValueError("need window >= min_pulls >= 1 and max_age >= 0")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError("epsilon must be in [0, 1]")


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _running(mean: float | None, x: float, weight: float = 0.25) -> float:
    """Exponential running mean (the first value starts it)."""
    return x if mean is None else mean + weight * (x - mean)


def _std(xs: Sequence[float]) -> float:
    """Sample standard deviation (0 for fewer than two values); plain floats, cheap enough for every step."""
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


class _BucketState:
    """Arms and reward windows of one bucket; `round` counts observations in this bucket."""

    def __init__(self, arms: Sequence[Arm], window: int) -> None:
        if not arms:
            raise ValueError("a bucket needs at least one arm")
        names = [a.name for a in arms]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate arm names: {names}")
        self.arms: list[Arm] = list(arms)
        self.round = 0
        self.obs: dict[str, deque[tuple[int, float]]] = {a.name: deque(maxlen=window) for a in arms}
        self.base_s = 0.0  # plain-decoding seconds of the steps seen (conservative exploration)
        self.loss_s = 0.0  # seconds SD steps cost beyond plain decoding of the same tokens (negative: SD won)
        self.step_loss: float | None = None  # running mean of one SD step's loss in this bucket

    def fresh(self, name: str, max_age: int) -> list[float]:
        window = self.obs[name]
        if max_age:
            while window and window[0][0] <= self.round - max_age:
                window.popleft()
        return [r for _, r in window]


class WindowBandit:
    """Base of the three policies: windows, expiry, forced exploration, serialisation."""

    kind: BanditKind

    def __init__(self, arms: Mapping[int, Sequence[Arm]], config: BanditConfig | None = None, seed: int = 0) -> None:
        # The class decides the policy; the config's kind follows it so a saved state rebuilds the same class.
        self.config = replace(config or BanditConfig(), kind=self.kind)
        self.rng = random.Random(seed)
        self._buckets: dict[int, _BucketState] = {b: _BucketState(a, self.config.window) for b, a in arms.items()}
        self.step_loss: float | None = None  # running mean of one SD step's loss over all buckets

    # ---- public interface -------------------------------------------------------------------------------------
    def buckets(self) -> list[int]:
        """The buckets the table has arms for."""
        return sorted(self._buckets)

    def arms(self, bucket: int) -> list[Arm]:
        return list(self._state(bucket).arms)

    def select(self, bucket: int) -> Arm:
        """The arm for the next step in `bucket`."""
        st = self._state(bucket)
        windows = {a.name: st.fresh(a.name, self.config.max_age) for a in st.arms}
        for arm in st.arms:
            if len(windows[arm.name]) < self.config.min_pulls:
                windows[arm.name] = windows[arm.name] + self._borrow(bucket, arm)
            if len(windows[arm.name]) < self.config.min_pulls:
                return self._affordable(st, arm)
        if len(st.arms) == 1:
            return st.arms[0]
        return self._affordable(st, self._choose(st.arms, windows))

    def observe(self, bucket: int, arm: Arm, tokens: int, seconds: float, active: int | None = None) -> None:
        """Record one step: `tokens` emitted across the batch of `active` sequences in `seconds` of wall time.

        Reward = tokens / seconds; with `config.per_sequence` and `active` given, divided by `active` (see
        BanditConfig)."""
        if seconds <= 0 or tokens < 0 or (active is not None and active < 1):
            raise ValueError(f"need seconds > 0, tokens >= 0, active >= 1 (got {tokens}, {seconds}, {active})")
        st = self._state(bucket)
        if arm.name not in st.obs:
            log.warning("bandit: arm %s is not in bucket %d (arms changed mid-step?); observation dropped", arm.name,
                        bucket)
            return
        st.round += 1
        per = active if self.config.per_sequence and active is not None else 1
        if arm.is_sd:
            rate = self._plain_rate(bucket)  # tokens/s of NO_SD per sequence (or per step)
            if rate:  # unmeasured, or plain steps that emitted nothing: no plain-time estimate for this step
                plain_s = tokens / (rate * per)
                st.base_s += plain_s
                st.loss_s += seconds - plain_s
                st.step_loss = _running(st.step_loss, seconds - plain_s)
                self.step_loss = _running(self.step_loss, seconds - plain_s)
        else:
            st.base_s += seconds
        st.obs[arm.name].append((st.round, tokens / seconds / per))

    def _plain_rate(self, bucket: int) -> float | None:
        """Median reward of the bucket's NO_SD arm (borrowed from a neighbour when unmeasured here)."""
        st = self._state(bucket)
        plain = next((a for a in st.arms if not a.is_sd), None)
        if plain is None:
            return None
        w = st.fresh(plain.name, self.config.max_age) or self._borrow(bucket, plain)
        return _median(w) if w else None

    def _affordable(self, st: _BucketState, arm: Arm) -> Arm:
        """`arm`, or NO_SD when an SD step would overdraw the bucket's loss budget (module docstring)."""
        budget = self.config.loss_budget
        if not arm.is_sd or budget is None:
            return arm
        expected = st.step_loss if st.step_loss is not None else (self.step_loss or 0.0)
        if st.loss_s + expected <= budget * st.base_s:
            return arm
        return next((a for a in st.arms if not a.is_sd), arm)

    def greedy(self, bucket: int) -> Arm:
        """The arm the policy currently rates best, without exploration (for reports)."""
        st = self._state(bucket)
        windows = {a.name: st.fresh(a.name, self.config.max_age) for a in st.arms}
        rated = [a for a in st.arms if windows[a.name]]
        if not rated:
            return st.arms[0]
        return max(rated, key=lambda a: _median(windows[a.name]))

    def set_arms(self, bucket: int, arms: Sequence[Arm]) -> None:
        """Replace a bucket's arms (e.g. the learned drafter became available); kept names keep their windows,
        new arms start empty and are explored first."""
        old = self._buckets.get(bucket)
        st = _BucketState(arms, self.config.window)
        if old is not None:
            st.round, st.base_s, st.loss_s, st.step_loss = old.round, old.base_s, old.loss_s, old.step_loss
            for name in st.obs.keys() & old.obs.keys():
                st.obs[name].extend(old.obs[name])
        self._buckets[bucket] = st

    def stats(self, bucket: int) -> list[dict]:
        """Per arm: fresh observation count, median and mean reward (tokens/s); for logs and the dashboard."""
        st = self._state(bucket)
        out = []
        for a in st.arms:
            w = st.fresh(a.name, self.config.max_age)
            out.append({"arm": a.name, "n": len(w), "median": _median(w) if w else None,
                        "mean": _mean(w) if w else None})
        return out

    def to_dict(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {
            "config": asdict(self.config),
            "rng": [version, list(internal), gauss],
            "step_loss": self.step_loss,
            "buckets": {
                str(b): {"round": st.round, "base_s": st.base_s, "loss_s": st.loss_s, "step_loss": st.step_loss,
                         "arms": [a.to_dict() for a in st.arms],
                         "obs": {n: [list(o) for o in w] for n, w in st.obs.items()}}
                for b, st in self._buckets.items()
            },
        }

    # ---- policy -----------------------------------------------------------------------------------------------
    def _choose(self, arms: list[Arm], windows: dict[str, list[float]]) -> Arm:
        raise NotImplementedError

    def _borrow(self, bucket: int, arm: Arm) -> list[float]:
        """Fresh rewards of the same arm in the nearest other bucket that has min_pulls of them (or none).

        "Same" = same drafter, depth and top-k: a tree keeps its shape across buckets while its verify budget
        follows the bucket, so the neighbour's tree is the closest measurement there is."""
        if not self.config.per_sequence or self._buckets[bucket].round >= self.config.share_rounds:
            return []
        family = (arm.drafter, arm.depth, arm.topk)
        for b in sorted(self._buckets, key=lambda b: (abs(b - bucket), b)):
            if b == bucket:
                continue
            st = self._buckets[b]
            for other in st.arms:
                if (other.drafter, other.depth, other.topk) == family:
                    w = st.fresh(other.name, self.config.max_age)
                    if len(w) >= self.config.min_pulls:
                        return w
        return []

    def _state(self, bucket: int) -> _BucketState:
        try:
            return self._buckets[bucket]
        except KeyError:
            raise KeyError(f"bucket {bucket} has no arms (known: {sorted(self._buckets)})") from None

    @staticmethod
    def _scale(windows: dict[str, list[float]]) -> float:
        """Largest fresh reward of the bucket: rewards / scale lie in [0, 1] (tokens/s has no fixed range)."""
        return max((max(w) for w in windows.values() if w), default=0.0) or 1.0


class EpsilonGreedyMedian(WindowBandit):
    """TLT's BEG-MAB: epsilon-greedy on the sliding-window median reward."""

    kind = "epsilon_greedy"

    def _choose(self, arms: list[Arm], windows: dict[str, list[float]]) -> Arm:
        if self.rng.random() < self.config.epsilon:
            return self.rng.choice(arms)
        medians = [_median(windows[a.name]) for a in arms]
        best = max(medians)
        return self.rng.choice([a for a, m in zip(arms, medians, strict=True) if m == best])


class SlidingUcb(WindowBandit):
    """UCB1 on normalised reward over sliding windows."""

    kind = "ucb"

    def _choose(self, arms: list[Arm], windows: dict[str, list[float]]) -> Arm:
        scale = self._scale(windows)
        n_total = sum(len(windows[a.name]) for a in arms)
        log_n = math.log(max(n_total, 2))

        def index(a: Arm) -> float:
            w = windows[a.name]
            return _mean(w) / scale + self.config.ucb_c * math.sqrt(2.0 * log_n / len(w))

        return max(arms, key=index)


class GaussianThompson(WindowBandit):
    """Thompson sampling with a Gaussian posterior on each arm's normalised window mean."""

    kind = "thompson"

    def _choose(self, arms: list[Arm], windows: dict[str, list[float]]) -> Arm:
        scale = self._scale(windows)
        best, best_sample = arms[0], -math.inf
        for a in arms:
            w = [r / scale for r in windows[a.name]]
            std = max(_std(w), self.config.prior_std)
            sample = self.rng.gauss(_mean(w), std / math.sqrt(len(w)))
            if sample > best_sample:
                best, best_sample = a, sample
        return best


BANDITS: dict[BanditKind, type[WindowBandit]] = {
    "epsilon_greedy": EpsilonGreedyMedian,
    "ucb": SlidingUcb,
    "thompson": GaussianThompson,
}


def make_bandit(arms: Mapping[int, Sequence[Arm]], config: BanditConfig | None = None, seed: int = 0) -> WindowBandit:
    """The policy `config.kind` over per-bucket arms (e.g. `arms_table(["ngram"])`)."""
    config = config or BanditConfig()
    return BANDITS[config.kind](arms, config, seed)


def bandit_from_dict(d: dict) -> WindowBandit:
    """Rebuild a bandit saved with `to_dict()`; it continues exactly (same windows, same random stream)."""
    config = BanditConfig(**d["config"])
    arms = {int(b): [Arm.from_dict(a) for a in st["arms"]] for b, st in d["buckets"].items()}
    bandit = make_bandit(arms, config)
    version, internal, gauss = d["rng"]
    bandit.rng.setstate((version, tuple(internal), gauss))
    bandit.step_loss = d.get("step_loss")
    for b, st in d["buckets"].items():
        state = bandit._buckets[int(b)]
        state.round = int(st["round"])
        state.base_s, state.loss_s = float(st.get("base_s", 0.0)), float(st.get("loss_s", 0.0))
        state.step_loss = st.get("step_loss")
        for name, obs in st["obs"].items():
            state.obs[name].extend((int(t), float(r)) for t, r in obs)
    return bandit
