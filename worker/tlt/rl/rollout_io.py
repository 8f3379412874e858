"""What the trainer needs from a rollout: `Trajectory` per generated response, and the `Rollout` protocol that
rl/engine_adapter.py implements around the rollout engine.

    trajs, sd_metrics = rollout(prompts, n, greedy, on_finish=lambda i, t: ...)
    # len(trajs) == len(prompts) * n, grouped by prompt: trajs[i*n:(i+1)*n] answer prompts[i]

`on_finish(i, trajectory)` is called once per response, i its index in `trajs`: as the response finishes when the
engine can tell (the rest of the batch still decoding), else after generation for every response; either way
before the call returns, from the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from worker.tlt.data.prompts import RenderedPrompt
from worker.tlt.rl.checkpoint import Stateful


@dataclass(frozen=True)
class Trajectory:
    prompt: RenderedPrompt
    response: tuple[int, ...]  # generated token ids, EOS included when the response stopped on it
    logprobs: tuple[float, ...] | None  # engine's target log-prob of each response token (processed distribution)
    finish_reason: str  # "stop" (EOS) | "length" (max_completion_length reached)


FinishCallback = Callable[[int, Trajectory], None]


class Rollout(Protocol):
    @property
    def generator(self) -> torch.Generator:
        """The generator each rollout draws its request seeds from, so all of its sampling (saved and restored by
        checkpoints)."""
        ...

    @property
    def sd_controller(self) -> Stateful | None:
        """The SD controller, whose learned state (bandit, step costs) checkpoints keep as the part "adaptive"
        (rl/trainer.py checkpoint_parts); None when decoding plainly."""
        ...

    def __call__(
        self, prompts: Sequence[RenderedPrompt], n: int, greedy: bool, on_finish: FinishCallback | None = None
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """n responses per prompt (greedy: temperature 0) -> (trajectories grouped by prompt, sd/* metrics)."""
        ...

    def on_weights_updated(self) -> None:
        """Called after each optimizer step (the weight-sync point)."""
        ...
