"""The adaptive SD controller the rollout engine calls once per decode step: switch + per-bucket bandit + metrics.

    ctl = AdaptiveSd.from_spec(spec.rollout, drafters=["ngram"])     # once per job (keeps the bandit's state)
    ctl.start_rollout()                                              # per rollout: switch off, fresh metrics
    arm = ctl.plan(active)                                           # per step: NO_SD, or the arm to draft with
    ... run the step with `arm` ...
    ctl.record(active, arm, emitted, seconds, accepted_per_pos=..., drafted_per_pos=...)  # or accepted=total
    reporter.metrics(step, ctl.metrics.summary())                    # per rollout

Speculative modes (the job spec's `rollout.speculative`): "off" never drafts; "on" drafts every step with the fixed
arm of the spec (draft_depth, draft_topk, verify_tokens: a chain, or a tree when draft_topk > 1, for every drafter)
-- a baseline, no bandit; "adaptive" switches SD by the active batch (SdSwitch), or by measured step costs
(CostSwitch, speculative/control/step_costs.py), and lets the bandit pick the arm per bucket, "none" included; with step costs,
an arm shape measured too slow to pay at any acceptance leaves its bucket's bandit and the larger buckets'. Fixed SD is this
controller with one arm (`AdaptiveSd.fixed(arm)`): the engine has one SD path.

Run the tests: `python -m pytest tests/adaptive/test_adaptive_controller.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from worker.tlt.speculative.arm import NO_SD, Arm, DrafterKind, fixed_arm
from worker.tlt.speculative.control.arm_buckets import ONE_GPU_BUCKETS, TLT_BUCKETS, BucketScheme, arms_table
from worker.tlt.speculative.control.bandit import BanditConfig, WindowBandit, bandit_from_dict, make_bandit
from worker.tlt.speculative.control.sd_metrics import RolloutSdMetrics
from worker.tlt.speculative.control.step_costs import CostSwitch, StepCostConfig, StepCosts
from worker.tlt.speculative.control.switch import SdSwitch, SwitchConfig

if TYPE_CHECKING:
    from worker.tlt.config import RolloutConfig


class AdaptiveSd:
    def __init__(self, switch: SwitchConfig, bandit: WindowBandit | None, fixed_arm: Arm = NO_SD,
                 scheme: BucketScheme = TLT_BUCKETS, costs: StepCosts | None = None, captures: bool = True) -> None:
        if switch.mode == "adaptive" and bandit is None:
            raise ValueError("adaptive mode needs a bandit")
        # costs: SD on where measured step costs say it pays (speculative/control/step_costs.py), below switch.off_threshold
        self.costs = costs
        self.switch = SdSwitch(switch) if costs is None else CostSwitch(switch, costs)
        self.bandit = bandit  # None unless adaptive
        self.fixed_arm = fixed_arm  # the arm of mode "on"
        self.scheme = scheme
        self.metrics = RolloutSdMetrics(on_below=switch.on_below, scheme=scheme, costs=costs)
        # (arm, bucket) pairs this process has run: the first SD step of each captures its verify and draft graphs
        # (seconds, next to ms steps), a one-time cost the bandit and the step costs must not learn from
        self._warm: set[tuple[str, int]] = set()
        self.captures = captures  # False (CPU: nothing is captured): every step is measured, the first ones too
        # arm shape (drafter, depth, topk) -> the smallest bucket from which it is out of the bandit, because its
        # measured steps there cost more than plain decoding could emit in the time at full acceptance (a tree at a
        # 7B-class width: 0.5 s against a 5 ms plain step); by shape, since a tree's verify width (its name) changes
        # from bucket to bucket
        self._hopeless: dict[tuple[str, int, int], int] = {}

    @classmethod
    def from_spec(cls, rollout: RolloutConfig, drafters: Sequence[DrafterKind],
                  scheme: BucketScheme = ONE_GPU_BUCKETS, step_costs: StepCostConfig | None = None,
                  sd_below: int | None = None, captures: bool = True) -> AdaptiveSd:
        """From the job spec's rollout section; `drafters` are the drafter kinds the engine has now; buckets: one
        GPU's (arms.ONE_GPU_BUCKETS), finer than TLT's. `step_costs`: switch by measured step costs (SD considered
        below `sd_below` active sequences, default the threshold switch's off point) instead of the threshold.
        `captures`: whether an arm's first step in a bucket captures graphs (CUDA), so is left out of what is learnt."""
        switch = SwitchConfig.from_rollout(rollout)
        if step_costs is not None and sd_below is not None:
            switch = SwitchConfig(mode=switch.mode, on_below=switch.on_below, patience=switch.patience,
                                  off_at=max(sd_below, switch.on_below + 1))
        kind = next((d for d in drafters if d != "none"), None)
        fixed = NO_SD
        if switch.mode == "on" and kind is not None:
            fixed = fixed_arm(kind, rollout.draft_depth, rollout.draft_topk, rollout.verify_tokens)
        bandit = None
        if switch.mode == "adaptive":
            bandit = make_bandit(arms_table(drafters, scheme), BanditConfig(kind=rollout.bandit), seed=rollout.seed)
        costs = StepCosts(step_costs, scheme) if step_costs is not None else None
        return cls(switch, bandit, fixed, scheme, costs, captures)

    @classmethod
    def fixed(cls, arm: Arm) -> AdaptiveSd:
        """SD with one arm at every step (the "on" baseline; tests and benchmarks of one drafter shape)."""
        return cls(SwitchConfig(mode="on"), None, arm)

    def start_rollout(self) -> None:
        """A new rollout starts with a full batch: switch off, metrics empty; the bandit keeps what it learned."""
        self.switch.reset()
        self.metrics = RolloutSdMetrics(on_below=self.switch.config.on_below, scheme=self.scheme, costs=self.costs)

    def plan(self, active: int) -> Arm:
        """The arm of this decode step (NO_SD = plain decoding). Call exactly once per step."""
        if not self.switch.update(active):
            return NO_SD
        if self.bandit is None:
            return self.fixed_arm
        bucket = self.scheme.bucket(active)
        arm = self.bandit.select(bucket)
        if not arm.is_sd and self.costs is not None and self.costs.free_probe(bucket):
            # a free probe measures SD (the arm measured least here), or the bucket would stay unjudged
            sd_arms = [a for a in self.bandit.arms(bucket) if a.is_sd]
            if sd_arms:
                arm = min(sd_arms, key=lambda a: self.costs.probed(bucket, a.name))  # type: ignore[union-attr]
        return arm

    def record(self, active: int, arm: Arm, emitted: int, seconds: float, accepted_per_pos: Sequence[int] = (),
               drafted_per_pos: Sequence[int] | None = None, accepted: int | None = None,
               sd_on: bool | None = None) -> None:
        """What the step planned with `arm` did; feeds the bandit (switch-on steps only), the step costs and the
        metrics. The first SD step of an arm in a bucket reaches the metrics only (it paid the graph captures).

        sd_on: the switch's state when that step was planned (default: its state now). An engine that plans several
        plain decode steps before it learns their emitted counts passes it, since the switch may have moved since."""
        on = self.switch.on if sd_on is None else sd_on
        bucket = self.scheme.bucket(active)
        learn = not arm.is_sd or not self.captures or (arm.name, bucket) in self._warm
        self._warm.add((arm.name, bucket))
        if self.costs is not None:
            self.costs.observe(active, arm.is_sd, emitted, seconds, first_use=not learn, arm=arm.name)
            if on and not arm.is_sd:  # the switch was on and the bandit chose plain decoding
                self.costs.decline(active)
            if arm.is_sd and learn and self.costs.cannot_pay(active, arm.name, arm.depth + 1):
                self._drop(bucket, arm)
        if on and self.bandit is not None and learn:
            self.bandit.observe(bucket, arm, emitted, seconds, active=active)
        self.metrics.observe_step(active=active, sd_on=on, arm=arm.name if on else None,
                                  verify_tokens=arm.verify_tokens, emitted=emitted, seconds=seconds,
                                  accepted_per_pos=accepted_per_pos, drafted_per_pos=drafted_per_pos,
                                  accepted=accepted)

    def _drop(self, bucket: int, arm: Arm) -> None:
        """Take `arm`'s shape out of this bucket and every larger one (drafting costs grow with the batch, acceptance
        does not)."""
        shape = _shape(arm)
        self._hopeless[shape] = min(bucket, self._hopeless.get(shape, bucket))
        self._prune_bandit()

    def _prune_bandit(self) -> None:
        if self.bandit is None:
            return
        for b in self.bandit.buckets():
            arms = self.bandit.arms(b)
            kept = [a for a in arms if self._hopeless.get(_shape(a), b + 1) > b]
            if len(kept) < len(arms):
                self.bandit.set_arms(b, kept)

    def all_arms(self) -> list[Arm]:
        """Every arm this controller can plan (the fixed arm and each bucket's bandit arms), e.g. to size the
        engine's KV headroom for the widest verify."""
        arms = [NO_SD, self.fixed_arm]
        if self.bandit is not None:
            for b in self.bandit.buckets():
                arms += self.bandit.arms(b)
        return arms

    def arms_for(self, active: int) -> list[Arm]:
        """The arms a step with this many active sequences can run (the fixed arm and its bucket's bandit arms)."""
        arms = [self.fixed_arm]
        if self.bandit is not None:
            try:
                arms += self.bandit.arms(self.scheme.bucket(active))
            except KeyError:  # a table without this bucket
                pass
        return arms

    def set_drafters(self, drafters: Sequence[DrafterKind]) -> None:
        """The drafters changed (e.g. the learned one is loaded): new arms are explored, kept ones keep their data."""
        if self.bandit is not None:
            for b, arms in arms_table(drafters, self.scheme).items():
                self.bandit.set_arms(b, arms)
            self._prune_bandit()  # what could not pay still cannot: its cost is the drafter's shape, not its weights

    def state_dict(self) -> dict:
        """For the checkpoint, what the controller learned across rollouts: the bandit, the step costs and the arm
        shapes dropped as unable to pay. Not the switch and metrics (per rollout), nor which arms have captured
        graphs: a resumed process captures them again, and those first steps must again stay unlearned."""
        return {
            "bandit": self.bandit.to_dict() if self.bandit is not None else None,
            "step_costs": self.costs.state_dict() if self.costs is not None else None,
            "hopeless": [[*shape, bucket] for shape, bucket in sorted(self._hopeless.items())],
        }

    def load_state_dict(self, d: dict) -> None:
        if d.get("bandit") is not None and self.bandit is not None:
            self.bandit = bandit_from_dict(d["bandit"])
        if d.get("step_costs") is not None and self.costs is not None:
            self.costs.load_state_dict(d["step_costs"])
        self._hopeless = {(str(k), int(depth), int(topk)): int(b) for k, depth, topk, b in d.get("hopeless", [])}


def _shape(arm: Arm) -> tuple[str, int, int]:
    return arm.drafter, arm.depth, arm.topk
