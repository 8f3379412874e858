"""`OnlineDrafterConfig`: what the online drafter (speculative/drafter/online.py) runs with, translated from the job spec by
worker/tlt/job_spec_translate.py (`drafter_config`); the drafter never reads the job spec itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OnlineKind = Literal["eagle1", "eagle3"]


@dataclass(frozen=True)
class OnlineDrafterConfig:
    kind: OnlineKind = "eagle1"  # drafter.kind: EAGLE-1 (final hidden) or EAGLE-3 (three target layers)
    warm_start_dir: str | None = None  # an exported drafter to start from (None: fresh weights)
    learning_rate: float = 3e-4  # the spot trainer's AdamW learning rate
    buffer_gb: float = 1.0  # hidden-state buffer budget (the last two RL steps' rollouts)
    max_train_steps_per_rl_step: int = 200  # spot-training cap per RL step (tail hook and after the update)
    train_after_update: bool = True  # after_update trains the rest of that cap (False: the tail only)
    draft_vocab_size: int = 0  # EAGLE-1 chain drafts over the N most frequent response tokens; 0 = all
    tail_below: int = 32  # rollout.sd_on_below: the tail (speculative/control/switch.in_tail) offers idle GPU time
    seed: int = 0  # the spot trainer's generators

    def __post_init__(self) -> None:
        if self.kind not in ("eagle1", "eagle3"):
            raise ValueError(f"an online drafter is eagle1 or eagle3, not {self.kind}")
