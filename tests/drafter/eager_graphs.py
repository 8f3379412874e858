"""CUDA graphs stood in for on the CPU: the proposer's `_record` replaced by `record_eagerly`, whose replay() re-runs
the recorded function into its static outputs, so the graphed draft paths (static buffers, padding, the draft window)
run in CPU tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


class ReplayEagerly:
    def __init__(self, run: Callable[[], tuple[torch.Tensor, ...]], out: tuple[torch.Tensor, ...]) -> None:
        self.run, self.out = run, out

    def replay(self) -> None:
        for o, n in zip(self.out, self.run(), strict=True):
            o.copy_(n)


def record_eagerly(self: object, run: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[ReplayEagerly, tuple]:
    """EagleProposer._record's stand-in (monkeypatched on the class): run once, replay by running again."""
    out = run()
    return ReplayEagerly(run, out), out
