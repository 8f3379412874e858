"""ZeRO stage 1 for the data-parallel policy update (`resources.zero_stage: 1`): AdamW's moments are sharded across
the ranks, weights and gradients stay replicated.

    shard_optimizer(trainer)               # before DataParallelUpdate registers its hook; trainer not stepped yet
    ...
    consolidate(trainer.optimizer)         # on every rank before rank 0 writes a checkpoint (a collective)

torch's `ZeroRedundancyOptimizer` assigns each parameter (whole, largest first, to the least loaded rank) to one
rank, which alone keeps its exp_avg / exp_avg_sq and steps it; after the step every owner broadcasts its updated
parameters, so all ranks again hold the same weights. The gradient path is update.py's, unchanged: the all-reduce and
the global-norm clip run in the step pre-hook, on the full replicated gradients, before the sharded step. Saves
8 bytes per trained parameter x (world-1)/world per rank (SmolLM2-135M with 2 ranks: ~0.54 of 1.1 GB); costs one
parameter broadcast per step (fp32 masters where there are any), 1.5x the traffic of the all-reduce-only update.
The broadcast goes parameter by parameter: `parameters_as_bucket_view=True` would batch it but re-points every
trained tensor's storage into a flat bucket, and without master weights those are the live weights the engine's
CUDA graphs were captured on.

Why not stage 2/3 or FSDP2: the rollout engine is colocated (it runs the very module being trained, CUDA graphs
included) and needs whole, plain weights on every rank. Sharding the weights (stage 3 / FSDP2) would need an
all-gather of the whole policy before every rollout plus a resident full copy for the engine, which gives back what
sharding saved. Stage 2 (sharded gradients) saves memory only when each gradient is reduce-scattered as the backward
produces it (DDP/FSDP's hooks, across micro-batches); reduced after the backward, as here, the full gradient exists
anyway (a reduce-scatter in place of the all-reduce would still bring the traffic back to plain DP's: a follow-up
once measured).

Checkpoints hold the consolidated (unsharded) state in the plain AdamW format: rank 0 writes it after `consolidate`,
and every rank loads the whole dict and keeps its own shard (`ShardedAdamW.load_state_dict`), so a run may resume
with either zero_stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from worker.tlt.rl.optim import adamw_kwargs, build_scheduler

if TYPE_CHECKING:
    from worker.tlt.rl.trainer import GRPOTrainer


class ShardedAdamW(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer over AdamW that keeps only this rank's shard in memory: the consolidated copy is
    dropped once handed out, and a loaded state is kept once (in the local AdamW), with fused step counters back on
    the device."""

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        self._all_state_dicts: list[dict[str, Any]] = []  # rank 0's consolidated copy of every shard: written once, not kept
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({**state_dict, "state": dict(state_dict["state"])})  # it overwrites other shards
        # the base class also fills the exposed `state` with a second copy of this rank's shard (never read again:
        # steps run in `self.optim`, state_dict() reads the consolidated shards)
        self.state.clear()
        for group in self.optim.param_groups:  # it moves 0-dim "step" to the CPU; fused/capturable AdamW wants it
            if group.get("fused") or group.get("capturable"):  # on the parameter's device
                for p in group["params"]:
                    st = self.optim.state.get(p)
                    if st and torch.is_tensor(st.get("step")):
                        st["step"] = st["step"].to(p.device)


def shard_optimizer(trainer: GRPOTrainer) -> ShardedAdamW:
    """Replace the trainer's AdamW (over the fp32 master params where there are any) by a ShardedAdamW with the same
    hyper-parameters, and rebuild its LR schedule on it. Needs an initialised process group; call before any step
    and before any hook is registered on the optimizer (the old one is dropped)."""
    if trainer.optimizer.state:
        raise RuntimeError("shard_optimizer must run before the first optimizer step")
    params = trainer.master.train_params
    opt = ShardedAdamW(params, optimizer_class=torch.optim.AdamW, **adamw_kwargs(params, trainer.algo))
    trainer.optimizer = opt
    trainer.scheduler = build_scheduler(opt, trainer.algo, total_steps=trainer.spec.max_steps)
    return opt


def consolidate(optimizer: torch.optim.Optimizer, to: int = 0) -> None:
    """Gather a sharded optimizer's state on rank `to` (every rank must call it); nothing for a plain one."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=to)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-parameter optimizer state (AdamW's exp_avg, exp_avg_sq) this rank holds."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return sum(t.numel() * t.element_size() for st in local.state.values() if st
               for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
