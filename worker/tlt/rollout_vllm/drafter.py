"""`VllmDrafter`: the job's online EAGLE-1 / EAGLE-3 drafter when vLLM runs the rollout.

    d = VllmDrafter(OnlineDrafter(drafter_config(spec), policy), load=engine.load_drafter)
    trainer = GRPOTrainer(..., drafter=d)      # d.update_capture rides the update's forward (rl/policy_forward.py)
    per RL step: d.begin_rollout()  ->  vLLM rollout  ->  update (rows captured)  ->  d.after_update(step, trajs)

vLLM's rollout exposes no hidden states, so the drafter's training rows come from the policy forward the update
already runs: for every response the update trains on, the prompt's last position and each fed response token with
the target's hidden state there (EAGLE-3: cat(its three feature layers' inputs, final hidden), the same rows our
engine's hook gives), computed with the weights that generated the rollout (the forward precedes the optimizer step).
They fill the `OnlineDrafter`'s buffer (the last two RL steps), its spot trainer trains after the update, and each
training round's weights reach vLLM's speculative model in place (`load`, our export's names: speculative/drafter/export.py).
There is no tail to harvest: `harvest/*` report 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from worker.tlt.speculative.drafter.export import eagle1_form, eagle3_form
from worker.tlt.speculative.drafter.online import OnlineDrafter

Load = Callable[[Iterable[tuple[str, torch.Tensor]]], list[str]]  # -> names of the served parameters written


class UpdateRows:
    """rl/policy_forward.py's UpdateCapture into the drafter's buffer: each micro-batch row a new sequence id."""

    def __init__(self, drafter: OnlineDrafter) -> None:
        self.drafter = drafter
        self.layers: tuple[int, ...] = drafter.capture_layers
        self.next_id = 0  # sequence ids stay unique across micro-batches and steps
        self.rows = 0  # rows captured since the last rollout began

    def __call__(self, tokens: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor) -> None:
        if tokens.numel() == 0:
            return
        ids = (rows + self.next_id).tolist()
        self.next_id += int(rows.max()) + 1
        self.drafter.buffer.capture(ids, tokens, hidden)
        self.rows += len(ids)


class VllmDrafter:
    """rl/trainer.py's DrafterHook for the vLLM backend."""

    def __init__(self, online: OnlineDrafter, load: Load, dtype: torch.dtype) -> None:
        self.online, self.load, self.dtype = online, load, dtype
        self.update_capture = UpdateRows(online)
        self.rollouts = 0
        self.loaded_at = online.trainer.steps  # spot-trainer steps of the weights vLLM serves
        self.loaded: list[str] = []  # vLLM's draft parameters the last reload wrote

    @property
    def train_drafter(self) -> Any:
        """The trained EagleDrafter (what the run's final export writes: run_dir.py export_final)."""
        return self.online.train_drafter

    def begin_rollout(self) -> None:
        """A training rollout starts: the rows the update captures next belong to a new buffer step."""
        self.rollouts += 1
        self.online.begin_rollout(self.rollouts)
        self.update_capture.rows = 0

    def serving_weights(self) -> dict[str, torch.Tensor]:
        """The trained drafter in the exported form vLLM loaded (our export's names, the policy's dtype)."""
        d = self.online.train_drafter
        form = eagle3_form if d.cfg.kind == "eagle3" else eagle1_form
        return form(d, self.dtype)[1]

    def after_update(self, step: int, trajectories: Sequence[Any]) -> dict[str, float]:
        if self.update_capture.rows == 0 and trajectories:
            raise RuntimeError("the drafter got no hidden states from the policy update's forward (the vLLM "
                               "backend trains it on them: the torch update engine hands them over)")
        metrics = self.online.after_update(step, trajectories)
        if self.online.trainer.steps != self.loaded_at:  # a training round ran: vLLM drafts with its weights
            self.loaded = self.load(self.serving_weights().items())
            self.loaded_at = self.online.trainer.steps
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"online": self.online.state_dict(), "rollouts": self.rollouts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.online.load_state_dict(state["online"])
        self.rollouts = int(state["rollouts"])
        self.loaded = self.load(self.serving_weights().items())
        self.loaded_at = self.online.trainer.steps
