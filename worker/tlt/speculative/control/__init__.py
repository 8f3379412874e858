"""Adaptive control of speculative decoding in the rollout engine (pure Python, no torch).

- switch.py: `SdSwitch`, SD on/off from the active batch size with hysteresis;
- arm_buckets.py: arm presets, `BucketScheme`, `default_arms()` (the `Arm` type, drafter x depth x top-k x verify
  tokens, is speculative/arm.py's, below the engine);
- bandit.py: per-bucket bandits choosing the arm (BEG-MAB epsilon-greedy, sliding UCB1, Gaussian Thompson);
- sd_metrics.py: `RolloutSdMetrics`, the sd/* and perf/tokens_per_s_* metrics of a rollout;
- controller.py: `AdaptiveSd`, the three above wired for the engine's loop (plan / record per step);
- sim.py: a simulated step-cost model where the best arm is known (tests, `python -m bench.bandit_sim`).

Per decode step the engine does `arm = ctl.plan(active)`, runs the step with it, then
`ctl.record(active, arm, emitted, seconds, accepted_per_pos)`; see controller.py.
"""

from worker.tlt.speculative.control.arm_buckets import (
    ONE_GPU_BUCKETS,
    TLT_BUCKETS,
    BucketScheme,
    arms_table,
    default_arms,
    verify_lengths,
)
from worker.tlt.speculative.control.bandit import BanditConfig, WindowBandit, bandit_from_dict, make_bandit
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.control.sd_metrics import RolloutSdMetrics, per_position_counts
from worker.tlt.speculative.control.switch import SdSwitch, SwitchConfig

__all__ = [
    "ONE_GPU_BUCKETS", "TLT_BUCKETS", "BucketScheme", "arms_table", "default_arms", "verify_lengths", "AdaptiveSd",
    "BanditConfig", "WindowBandit", "bandit_from_dict", "make_bandit",
    "RolloutSdMetrics", "per_position_counts", "SdSwitch", "SwitchConfig",
]
