"""The policy update as a part of the RL step: what runs the optimizer over the losses of a step's micro-batches.
The trainer is handed one at construction and never branches on which it is.

    updater = build_updater(spec, model, device)     # TorchUpdate, or rl/deepspeed_update.py DeepSpeedUpdate
    per RL step: updater.begin()
                 for each micro-batch: loss = loss_of(updater.policy_logits(ids, at)); updater.backward(loss, last)
                 grad_norm = updater.step()          # clipped by the global norm; returns the norm before clipping
                 updater.sync_engine_weights()       # the rollout engine's weights := the trained ones

Three updaters: `TorchUpdate` (AdamW in this process, fp32 master weights for bf16 models, rl/optim.py),
multigpu/update.py `DataParallelTorchUpdate` (the same, with the ranks' gradients all-reduced before the clip) and
`DeepSpeedUpdate` (ZeRO stages, offload; it reduces across ranks itself). Build the updater before the rollout
engine: DeepSpeed may move the weights into its flat buffers, and the engine's CUDA graphs read their addresses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from worker.tlt.config import AlgorithmConfig, JobSpec
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.deepspeed_update import build_update
from worker.tlt.rl.optim import MasterWeights, build_optimizer, trainable_params, use_master_weights
from worker.tlt.rl.policy_forward import ResponseLogits, UpdateCapture
from worker.tlt.rl.update_plan import UpdatePlan


class Updater(Protocol):
    plan: UpdatePlan  # the memory arithmetic that chose this updater (rl/update_plan.py)
    optimizer: torch.optim.Optimizer  # whose param groups' lr the trainer's schedule sets
    master: MasterWeights  # fp32 copies of bf16 weights (disabled where the updater keeps its own)

    def policy_logits(self, input_ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """[b, S] token ids, [n] flat response positions -> [n, V] logits (rl/policy_forward.py)."""
        ...

    def begin(self) -> None:
        """Before a step's first micro-batch: train mode, gradients cleared."""

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backward of one micro-batch's loss; `last` closes the step's accumulation."""

    def step(self) -> torch.Tensor | float:
        """The optimizer step, clipped by the global gradient norm; returns that norm before clipping."""
        ...

    def sync_engine_weights(self) -> None:
        """The rollout engine's weights := the trained ones (every rank calls it)."""


class TorchUpdate:
    """torch AdamW in this process: gradients into fp32 master copies where the model is bf16, clip, step, round the
    step back into the live weights (which the rollout engine runs)."""

    def __init__(self, model: Transformer, algo: AlgorithmConfig, plan: UpdatePlan,
                 capture: UpdateCapture | None = None) -> None:
        self.plan = plan
        self.master = MasterWeights(trainable_params(model), enabled=use_master_weights(model, algo))
        self.optimizer = build_optimizer(self.master.train_params, algo)
        self.max_grad_norm = algo.max_grad_norm
        self.forward = ResponseLogits(model, capture)  # capture: hidden states for a drafter fed by the update

    def policy_logits(self, input_ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # [b, S], [n] -> [n, V]
        return self.forward(input_ids, at)

    def begin(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()
        self.master.accumulate_grads()  # fp32 copies' grads (no-op without master weights)

    def clip_grads(self) -> torch.Tensor:
        """Clip the gradients the optimizer steps by their norm; returns that norm (a data-parallel updater reduces
        them across ranks first)."""
        return torch.nn.utils.clip_grad_norm_(self.master.train_params, self.max_grad_norm)

    def step(self) -> torch.Tensor:
        norm = self.clip_grads()
        self.optimizer.step()
        self.master.write_back()  # the engine's weights := the fp32 step, rounded (no-op without masters)
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def sync_engine_weights(self) -> None:
        """Nothing to copy: the engine runs the module this updater steps."""


def build_updater(spec: JobSpec, model: Transformer, device: torch.device,
                  loss_scale: Callable[[], float] | None = None, capture: UpdateCapture | None = None) -> Updater:
    """The updater the spec's resources and the memory arithmetic choose (rl/update_plan.py): DeepSpeed's or torch
    AdamW here. `loss_scale`: a DeepSpeed update's factor on each rank's loss under data parallelism (its share of
    the global normaliser x world, multigpu/data_parallel.py); torch data parallelism is multigpu/update.py's."""
    plan, ds = build_update(spec, model, device, loss_scale=loss_scale)
    if ds is None:
        return TorchUpdate(model, spec.algorithm, plan, capture)
    if capture is not None:
        raise ValueError("this job's drafter trains on the hidden states of the update's forward, which DeepSpeed's "
                         "engine does not hand over: set resources.update_engine: torch")
    return ds
