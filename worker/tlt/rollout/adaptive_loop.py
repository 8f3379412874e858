"""The adaptive engine's per-iteration loop: plan an arm with the SD controller (rollout/controller.py), run a
speculative step with that arm's drafter or a window of plain decode steps, record what happened, and give the tail
hook its share.

`Engine.generate` calls `adaptive_iteration` once per loop iteration when it holds a controller (between its
admission of waiting requests and `sync()`). Per decode step the controller is asked exactly once (`plan(active)`):

- an SD arm -> one `Engine.speculative_step(active, arm)` (draft with `engine.proposers[arm.drafter]`, the arm's depth
  / top-k / verify width), then `record(...)` with emitted tokens, step seconds and accepted / drafted per position;
- NO_SD -> plain decode steps (the CUDA-graph path) in a window of up to `EngineConfig.sync_every` steps without a
  host sync; before each further step of the window the controller is asked again, and when it answers an SD arm
  the window ends and that arm is kept for the next iteration (re-planned if the active batch changed bucket at the
  sync in between, the only case where a step is planned twice). The window's steps are recorded once their
  emitted counts are read, each with the switch state it was planned under.

Nothing is re-prefilled when SD turns on or off: the KV cache and the row state are the engine's, and a drafter
catches up from the histories (n-gram index, small-model cache) or from the hidden-state hook (EAGLE).

Tail hook: `TailBudget` hands the engine's optional `tail_hook(budget_s)` (e.g. the drafter's spot training) a
credit earned by steps run with the switch on (`EngineConfig.tail_budget` of their wall time, banked up to
`tail_credit_cap_s`); time the hook takes is charged against the credit, so overall it costs about that fraction
of the tail, plus at most one overrun.

Run the tests: `python -m pytest tests/adaptive/test_adaptive_engine_loop.py -q`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.tlt.decoding.arms import Arm
from worker.tlt.rollout.controller import SdController
from worker.tlt.rollout.engine_state import EngineState, StepRunner
from worker.tlt.rollout.types import StepStats

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
        """After a step run with the switch on: earn credit, and call the hook when there is any."""
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


def _plan(ctl: SdController, active: int) -> tuple[Arm, bool]:
    arm = ctl.plan(active)
    return arm, ctl.switch.on


def adaptive_iteration(state: EngineState, runner: StepRunner, ctl: SdController, steps: list[StepStats],
                       pending: Pending | None, tail: TailBudget) -> Pending | None:
    """One iteration of the adaptive loop over rows 0..state.n_active-1 (module docstring), stepping with `runner`
    (the engine); returns the arm planned for the next iteration, if the controller already chose one."""
    active = state.n_active
    scheme = ctl.scheme
    if pending is not None and scheme.bucket(pending[2]) == scheme.bucket(active):
        arm, on = pending[0], pending[1]
    else:
        arm, on = _plan(ctl, active)
    if arm.is_sd:
        st = runner.speculative_step(active, arm)
        steps.append(st)
        ctl.record(active, arm, st.emitted, st.seconds, accepted_per_pos=st.accepted_pos,
                   drafted_per_pos=st.drafted_pos, sd_on=on)
        if on:
            tail.earn_and_spend(st.seconds)
        return None
    planned: list[tuple[Arm, bool]] = [(arm, on)]
    nxt: Pending | None = None
    batch = state.bucket(active)
    clock = state.clock
    t0 = clock()
    emitted = [runner.decode_step(batch).sum()]
    while len(emitted) < state.config.sync_every:
        a2, on2 = _plan(ctl, active)
        if a2.is_sd:
            nxt = (a2, on2, active)
            break
        planned.append((a2, on2))
        emitted.append(runner.decode_step(batch).sum())
    counts = torch.stack(emitted).tolist()
    dt = max(clock() - t0, 1e-9) / len(counts)
    for (a, was_on), c in zip(planned, counts, strict=True):
        steps.append(StepStats("decode", active, batch, 1, int(c), 0, dt, arm=a.name))
        ctl.record(active, a, int(c), dt, sd_on=was_on)
    n_on = sum(was_on for _, was_on in planned)
    if n_on:
        tail.earn_and_spend(dt * n_on)
    return nxt
