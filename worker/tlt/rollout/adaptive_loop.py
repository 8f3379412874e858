"""The adaptive engine's decode loop: plan an arm with the SD controller (rollout/controller_protocol.py), run a speculative
step with that arm's drafter or a window of plain decode steps, record what happened, and give the tail hook its
share.

`Engine.generate` builds one `AdaptiveLoop` when it holds a controller and calls `iteration()` once per loop
iteration (between its admission of waiting requests and `sync()`). Per decode step the controller is asked exactly
once (`plan(active)`):

- an SD arm -> one `Engine.speculative_step(active, arm)` (draft with `engine.proposers[arm.drafter]`, the arm's depth
  / top-k / verify width), then `record(...)` with emitted tokens, step seconds and accepted / drafted per position;
- NO_SD -> plain decode steps (the CUDA-graph path) in a window of up to `EngineConfig.sync_every` steps without a
  host sync, on CUDA launched one window ahead of its read like the plain engine's (rollout/windows.py: the host's
  reads, records and hidden-state hook overlap the next window); before each further step of the window the
  controller is asked again, and when it answers an SD arm the window ends, is read at once, and that arm is kept
  for the next iteration. An SD arm planned while a window is still in flight waits one iteration too: the window
  is read and the rows synced first. A kept arm is planned again only if the active batch changed bucket at the
  sync in between. The window's steps are recorded when their emitted counts are read (a window late on CUDA),
  each with the switch state it was planned under.

Nothing is re-prefilled when SD turns on or off: the KV cache and the row state are the engine's, and a drafter
catches up from the histories (n-gram index, small-model cache) or from the hidden-state hook (EAGLE).

Tail hook: `TailBudget` hands the engine's optional `tail_hook(budget_s)` (e.g. the drafter's spot training) a
credit earned by steps run with the switch on (`EngineConfig.tail_budget` of their wall time, banked up to
`tail_credit_cap_s`); time the hook takes is charged against the credit, so overall it costs about that fraction
of the tail, plus at most one overrun. A switch driven by step costs stays off where SD does not pay, so a drafter
that has never paid trains only after the update there (`drafter.train_after_update`) or from a warm start.

Run the tests: `python -m pytest tests/adaptive/test_adaptive_engine_loop.py -q`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from worker.tlt.rollout.controller_protocol import SdController
from worker.tlt.rollout.engine_state import EngineState, StepRunner
from worker.tlt.rollout.types import StepStats
from worker.tlt.rollout.windows import PlainWindows
from worker.tlt.speculative.arm import Arm

TailHook = Callable[[float], object]  # (time budget in seconds) -> anything; called between tail decode steps
Pending = tuple[Arm, bool, int]  # (arm planned, switch state when planned, active batch it was planned for)


class TailBudget:
    """Credit for the tail hook (module docstring)."""

    def __init__(self, hook: TailHook | None, fraction: float, cap_s: float, clock: Callable[[], float]) -> None:
        self.hook, self.fraction, self.cap_s, self.clock = hook, fraction, cap_s, clock
        self.credit = 0.0  # seconds the hook may still use
        self.used_s = 0.0  # seconds spent in the hook (this generate)
        self.calls = 0

    def reset(self) -> None:
        self.credit, self.used_s, self.calls = 0.0, 0.0, 0

    def earn_and_spend(self, step_seconds: float) -> None:
        """After steps run with the switch on (their seconds): earn credit, and call the hook when there is any."""
        if self.hook is None or self.fraction <= 0.0:
            return
        self.credit = min(self.credit + self.fraction * step_seconds, self.cap_s)
        if self.credit <= 0.0:
            return
        t0 = self.clock()
        with torch.enable_grad():  # generate() runs under no_grad; a spot-training hook needs autograd
            self.hook(self.credit)
        spent = self.clock() - t0
        self.credit -= spent
        self.used_s += spent
        self.calls += 1


Planned = tuple[Arm, bool]  # (arm, the switch's state when it was planned)


class AdaptiveLoop:
    """The adaptive engine's decode loop over one generate() (module docstring)."""

    def __init__(self, state: EngineState, runner: StepRunner, ctl: SdController, tail: TailBudget) -> None:
        self.state, self.runner, self.ctl, self.tail = state, runner, ctl, tail
        self.windows = PlainWindows(state, runner, on_read=self._record_plain)  # one ahead of its reads on CUDA
        self.pending: Pending | None = None  # an SD arm planned at the end of the last plain window

    def _plan(self, active: int) -> Planned:
        arm = self.ctl.plan(active)
        return arm, self.ctl.switch.on

    def iteration(self, steps: list[StepStats]) -> bool:
        """One iteration over rows 0..state.n_active-1: a speculative step or a plain window -> True when the host has
        done flags for the current rows (call Engine.sync)."""
        active = self.state.n_active
        pending, self.pending = self.pending, None
        if pending is not None and self.ctl.scheme.bucket(pending[2]) == self.ctl.scheme.bucket(active):
            arm, on = pending[0], pending[1]
        else:
            arm, on = self._plan(active)
        if arm.is_sd:
            if self.windows.inflight is not None:  # a plain window still runs: read it and sync first
                self.pending = (arm, on, active)
                return self.windows.drain(steps)
            st = self.runner.speculative_step(active, arm)
            steps.append(st)
            self.ctl.record(active, arm, st.emitted, st.seconds, accepted_per_pos=st.accepted_pos,
                            drafted_per_pos=st.drafted_pos, sd_on=on)
            if on:
                self.tail.earn_and_spend(st.seconds)
            return True

        def next_label() -> Planned | None:
            a2, on2 = self._plan(active)
            if a2.is_sd:  # the window ends here; that arm runs next
                self.pending = (a2, on2, active)
                return None
            return a2, on2

        return self.windows.step(steps, (arm, on), next_label)

    def _record_plain(self, recs: list[StepStats], labels: list[Planned]) -> list[StepStats]:
        """A read window's steps: each recorded with the arm and switch state it was planned under."""
        out = []
        for st, (arm, was_on) in zip(recs, labels, strict=True):
            out.append(replace(st, arm=arm.name))
            self.ctl.record(st.active, arm, st.emitted, st.seconds, sd_on=was_on)
        n_on = sum(on for _, on in labels)
        if n_on:
            self.tail.earn_and_spend(recs[0].seconds * n_on)
        return out
