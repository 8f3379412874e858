"""SD on/off from the active batch size, with hysteresis (TLT's adaptive rollout engine, first decision).

While many sequences are active, plain batched decoding is compute-bound and drafting only costs time; as
sequences finish the batch turns memory-bound and speculative decoding pays. `SdSwitch.update(active)` is called
once per decode step and returns whether this step runs SD:

- off -> on after `patience` consecutive steps with active < on_below;
- on -> off after `patience` consecutive steps with active >= off_at (off_at > on_below);
- anything in between resets the pending streak, so a batch hovering at the threshold never flaps.

Pure Python (no torch); the engine owns the KV cache, so a switch needs no re-prefill.

Run the tests: `python -m pytest tests/adaptive/test_adaptive_switch.py -q`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from worker.tlt.config import RolloutConfig

SwitchMode = Literal["off", "on", "adaptive"]


def in_tail(active: int, on_below: int) -> bool:
    """The one definition of the rollout's tail: fewer than `on_below` (the spec's `rollout.sd_on_below`) sequences
    active, the memory-bound part where SD switches on, the metrics count tail speed and the drafter's spot training
    counts idle GPU time."""
    return active < on_below


@dataclass(frozen=True)
class SwitchConfig:
    mode: SwitchMode = "adaptive"  # "off"/"on" pin SD for every step (baselines); adaptive: by the active batch
    on_below: int = 32  # TLT: SD on when fewer than 32 sequences are active ...
    patience: int = 3  # ... for this many consecutive decode steps (and the same to switch back off)
    off_at: int | None = None  # SD off again at >= this many active; None = ceil(1.5 * on_below)

    def __post_init__(self) -> None:
        if self.on_below < 1 or self.patience < 1:
            raise ValueError("on_below and patience must be >= 1")
        if self.off_at is not None and self.off_at <= self.on_below:
            raise ValueError(f"off_at ({self.off_at}) must be > on_below ({self.on_below})")

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig) -> SwitchConfig:
        """From the job spec's rollout section (speculative, sd_on_below, sd_patience)."""
        return cls(mode=rollout.speculative, on_below=rollout.sd_on_below, patience=rollout.sd_patience)

    @property
    def off_threshold(self) -> int:
        return self.off_at if self.off_at is not None else max(self.on_below + 1, math.ceil(1.5 * self.on_below))


class SdSwitch:
    """Stateful hysteresis switch; one per rollout (call `reset()` between rollouts to start off)."""

    def __init__(self, config: SwitchConfig | None = None) -> None:
        self.config = config or SwitchConfig()
        self._on = self.config.mode == "on"
        self._streak = 0  # consecutive steps voting to flip the current state
        self.flips = 0  # number of state changes since reset (a metric of flapping)

    @property
    def on(self) -> bool:
        return self._on

    def reset(self) -> None:
        self._on = self.config.mode == "on"
        self._streak = 0
        self.flips = 0

    def update(self, active: int) -> bool:
        """Feed this step's active batch size; returns True when this step runs SD."""
        cfg = self.config
        if cfg.mode != "adaptive":
            return self._on
        wants_flip = active >= cfg.off_threshold if self._on else in_tail(active, cfg.on_below)
        self._streak = self._streak + 1 if wants_flip else 0
        if self._streak >= cfg.patience:
            self._on = not self._on
            self._streak = 0
            self.flips += 1
        return self._on

    def to_dict(self) -> dict:
        return {"on": self._on, "streak": self._streak, "flips": self.flips}

    def load_dict(self, d: dict) -> None:
        self._on, self._streak, self.flips = bool(d["on"]), int(d["streak"]), int(d["flips"])
