"""Data parallelism applied to a single-GPU trainer from outside, and the step strategy that runs the training loop
(rl/loop.py `train_loop`) as one rank of a multi-GPU job.

    trainer, val = build_trainer(spec, reporter)
    dp = apply_data_parallel(trainer, ctx)           # sharded rollout + harvest + DP or DeepSpeed update + drafter
                                                     # + advantage statistics summed over the ranks
    train_loop(spec, trainer, dp, val, run_dir, reporter, resume=True)

Every rank runs every collective in the same order: the stop decision (an all-reduce, so a cancel seen by one rank
stops all at the same step), the step (rollout gather, gradient all-reduce, drafter broadcast, the metric gather),
validation (sharded, gathered), the checkpoint (`check_replicas` proves the policies identical; a DeepSpeed update
has every rank write its optimizer shard, rl/loop.py). Rank 0 reports, writes checkpoints and exports; all ranks read
the same checkpoint.

The update: the torch data-parallel update (update.py: replicated AdamW, gradients all-reduced in a step pre-hook)
or, when the trainer runs DeepSpeed (`trainer.ds`, rl/deepspeed_update.py: ZeRO stages 1-3, offload), DeepSpeed's
engine, which reduces, clips and partitions itself; each rank's loss is then scaled by its share of the global
normaliser x world (DeepSpeed averages the ranks' gradients), so the step is the single-process step over the whole
batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.tlt.multigpu.context import DistContext
from worker.tlt.multigpu.harvest import DistDrafterHook, Harvester
from worker.tlt.multigpu.metrics import merge_step_metrics
from worker.tlt.multigpu.rollout_shard import ShardedRollout
from worker.tlt.multigpu.update import DataParallelUpdate, check_replicas, loss_share
from worker.tlt.rl.loop import StepResult
from worker.tlt.rl.optim import optimizer_state_bytes
from worker.tlt.rl.trainer import GRPOTrainer

if TYPE_CHECKING:
    from worker.tlt.drafter.online import OnlineDrafter


class DataParallel:
    """The pieces `apply_data_parallel` installed on a trainer, and the loop's step strategy for this rank."""

    def __init__(self, ctx: DistContext, rollout: ShardedRollout, update: DataParallelUpdate | None,
                 drafter: OnlineDrafter | None) -> None:
        self.ctx, self.rollout, self.update, self.drafter = ctx, rollout, update, drafter

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def world(self) -> int:
        return self.ctx.world

    def resumed(self, trainer: GRPOTrainer, step: int) -> None:
        self.rollout.calls = step  # one training rollout per step: the per-rank sampling seeds continue from there
        check_replicas(self.ctx, trainer.model)

    def should_stop(self, requested: bool) -> bool:
        return self.ctx.any(requested)

    def step(self, trainer: GRPOTrainer) -> StepResult:
        """One RL step on every rank; the metrics and histogram of all ranks merged (metrics.py)."""
        _, samples, per_rank = dist_step(trainer, self)
        merged, hist = merge_step_metrics(per_rank, self.rollout.last_gather, trainer.algo)
        return merged, samples, hist

    def before_checkpoint(self, trainer: GRPOTrainer) -> None:
        check_replicas(self.ctx, trainer.model)

    def barrier(self) -> None:
        self.ctx.barrier()


def apply_data_parallel(trainer: GRPOTrainer, ctx: DistContext) -> DataParallel:
    """Turn a single-GPU trainer into one rank of a data-parallel job, in place (see the module docstring)."""
    spec = trainer.spec
    if spec.algorithm.prompts_per_step < ctx.world:
        raise ValueError(f"prompts_per_step={spec.algorithm.prompts_per_step} is below the {ctx.world} ranks: "
                         "a rank with no prompts would have no update to join")
    inner = trainer.rollout
    drafter = getattr(inner, "drafter", None)
    engine = getattr(inner, "engine", None)
    if engine is not None and getattr(engine, "tail", None) is not None:
        engine.tail.hook = None  # per-rank tail training would diverge the drafter copies (harvest.py)
    harvester = Harvester(ctx, drafter, spec.drafter.max_train_steps_per_rl_step)
    rollout = ShardedRollout(inner, ctx, harvester, seed=spec.seed + spec.rollout.seed)
    trainer.rollout = rollout
    trainer.batch_sums = ctx.all_reduce_floats  # batch-wide advantages (REINFORCE++) see every rank's shard
    if drafter is not None:
        trainer.drafter = DistDrafterHook(ctx, drafter, lambda: [s.harvest for s in rollout.last_gather])
    update = None
    if trainer.ds is not None:
        if trainer.algo.dynamic_sampling:
            raise ValueError("algorithm.dynamic_sampling is not supported with resources.gpus > 1 yet")
        algorithm, cfg, rank, world = trainer.algorithm, trainer.algo, ctx.rank, ctx.world
        trainer.ds.loss_scale = lambda: loss_share(algorithm, cfg, rollout.last_gather, rank) * world
    else:
        update = DataParallelUpdate(ctx, trainer, rollout)
    return DataParallel(ctx, rollout, update, drafter)


def dist_step(trainer: GRPOTrainer, dp: DataParallel) -> tuple[dict[str, float], list[dict], list[dict[str, float]]]:
    """One RL step on every rank. Returns (this rank's metrics, its sample rows, every rank's metrics) with the
    gradient norm and loss of the data-parallel update in place of the trainer's local ones (DeepSpeed's norm is
    already global), and this rank's optimizer state size (divided across ranks by ZeRO) and, on CUDA, its peak
    memory."""
    metrics, samples, _ = trainer.step()
    metrics["perf/optimizer_state_mib"] = optimizer_state_bytes(trainer.optimizer) / 2**20
    if dp.ctx.device.type == "cuda":  # the allocator's high-water mark so far (KV cache, rollout and update)
        metrics["perf/peak_mem_mib"] = torch.cuda.max_memory_allocated(dp.ctx.device) / 2**20
    if dp.update is not None:
        metrics["actor/grad_norm"] = dp.update.last_grad_norm
    metrics["actor/pg_loss"] *= loss_share(trainer.algorithm, trainer.algo, dp.rollout.last_gather, dp.ctx.rank)
    return metrics, samples, dp.ctx.all_gather_objects(metrics)
