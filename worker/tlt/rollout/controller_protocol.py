"""What the engine needs of an SD controller: the `SdController` protocol the engine and its adaptive loop call.

The engine asks its controller once per decode step for an arm (`plan`), runs the step with it, and reports what it
did (`record`); at construction it reads every arm the controller can plan (`all_arms`, the KV headroom and the
drafters it needs), at warm-up the arms per batch (`arms_for`) up to where the switch turns SD off again, per
rollout it calls `start_rollout` and returns the controller's metrics. speculative/control/controller.py's `AdaptiveSd` is the
implementation; the engine depends on this protocol only, so the layers above it pick the controller (mypy checks
`AdaptiveSd` against it wherever one is passed to `Engine`).

Members are read-only properties: an implementation may hold narrower types (a `SwitchConfig` with a literal
mode, a `BucketScheme`) without the protocol fixing them.

Run the tests: `python -m pytest tests/engine/test_engine_controller.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from worker.tlt.speculative.arm import Arm


class SwitchSettings(Protocol):
    @property
    def mode(self) -> str: ...  # "on": SD at every batch size; else only below off_threshold

    @property
    def off_threshold(self) -> int: ...  # SD is off at and above this many active sequences (mode != "on")


class SdSwitchView(Protocol):
    @property
    def on(self) -> bool: ...  # the switch's state now (after the last plan)

    @property
    def config(self) -> SwitchSettings: ...


class BatchBuckets(Protocol):
    def bucket(self, active: int) -> int: ...  # the bucket of an active batch size; a plan holds within one


class SdMetricsView(Protocol):
    def summary(self) -> dict[str, float]: ...  # GenerationOutput.sd_metrics

    def per_bucket(self) -> list[dict]: ...  # GenerationOutput.sd_buckets


@runtime_checkable
class SdController(Protocol):
    @property
    def switch(self) -> SdSwitchView: ...

    @property
    def scheme(self) -> BatchBuckets: ...

    @property
    def metrics(self) -> SdMetricsView: ...

    def start_rollout(self) -> None: ...

    def plan(self, active: int) -> Arm: ...  # the arm of this decode step (NO_SD = plain); once per step

    def record(self, active: int, arm: Arm, emitted: int, seconds: float, accepted_per_pos: Sequence[int] = ...,
               drafted_per_pos: Sequence[int] | None = ..., *, sd_on: bool | None = ...) -> None: ...

    def all_arms(self) -> list[Arm]: ...

    def arms_for(self, active: int) -> list[Arm]: ...
