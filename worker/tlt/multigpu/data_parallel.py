"""One rank of a multi-GPU job: the trainer built from data-parallel parts, and the step strategy that runs the
training loop (rl/loop.py `train_loop`) on every rank.

    trainer, dp, val = build_rank(spec, reporter, ctx)   # sharded rollout + harvest + DP or DeepSpeed update +
                                                         # drafter broadcast + advantage statistics summed over ranks
    train_loop(spec, trainer, dp, val, run_dir, reporter, resume=True)

The parts, chosen here and handed to `GRPOTrainer` (the model code and the trainer are the single-device ones;
parallelism is which parts they are given): `ShardedRollout` around the single-device rollout built without
tail training (rollout_shard.py), `DataParallelTorchUpdate` or a DeepSpeed update whose loss scale is this rank's
share (update.py), `DistDrafterHook` (harvest.py), and `ctx.all_reduce_floats` for batch-wide advantages. They
share one `StepShards`, the ranks' summaries of the step's rollout.

Every rank runs every collective in the same order: the stop decision (an all-reduce, so a cancel seen by one rank
stops all at the same step), the step (rollout gather, gradient all-reduce, drafter broadcast, the metric gather),
validation (sharded, gathered), the checkpoint (`check_replicas` proves the policies identical; a DeepSpeed update
has every rank write its optimizer shard, rl/loop.py). Rank 0 reports, writes checkpoints and exports; all ranks read
the same checkpoint.

The update: the torch data-parallel update (update.py: replicated AdamW, gradients all-reduced before the clip)
or, when the plan runs on DeepSpeed (`trainer.ds`, rl/deepspeed_update.py: ZeRO stages 1-3, offload), DeepSpeed's
engine, which reduces, clips and partitions itself; each rank's loss is then scaled by its share of the global
normaliser x world (DeepSpeed averages the ranks' gradients), so the step is the single-process step over the whole
batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.tlt.build import load_job, report_built
from worker.tlt.config import JobSpec
from worker.tlt.data.prompts import RenderedPrompt
from worker.tlt.multigpu.context import DistContext
from worker.tlt.multigpu.harvest import DistDrafterHook, Harvester
from worker.tlt.multigpu.metrics import merge_step_metrics
from worker.tlt.multigpu.rollout_shard import ShardedRollout, StepShards
from worker.tlt.multigpu.update import DataParallelTorchUpdate, check_replicas, loss_share
from worker.tlt.reporting import Reporter
from worker.tlt.rl.algorithms.registry import resolve
from worker.tlt.rl.deepspeed_update import build_update
from worker.tlt.rl.engine_adapter import make_rollout
from worker.tlt.rl.loop import StepResult
from worker.tlt.rl.optim import optimizer_state_bytes
from worker.tlt.rl.trainer import GRPOTrainer
from worker.tlt.rl.updater import Updater

if TYPE_CHECKING:
    from worker.tlt.speculative.drafter.online import OnlineDrafter


class DataParallel:
    """The loop's step strategy for one rank, over the parts `build_rank` handed its trainer."""

    def __init__(self, ctx: DistContext, rollout: ShardedRollout, shards: StepShards,
                 update: DataParallelTorchUpdate | None, drafter: OnlineDrafter | None) -> None:
        self.ctx, self.rollout, self.shards, self.update, self.drafter = ctx, rollout, shards, update, drafter

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
        merged, hist = merge_step_metrics(per_rank, self.shards.last_gather, trainer.algo)
        return merged, samples, hist

    def before_checkpoint(self, trainer: GRPOTrainer) -> None:
        check_replicas(self.ctx, trainer.model)

    def barrier(self) -> None:
        self.ctx.barrier()


def build_rank(spec: JobSpec, reporter: Reporter, ctx: DistContext
               ) -> tuple[GRPOTrainer, DataParallel, list[RenderedPrompt]]:
    """This rank's trainer from its parts (see the module docstring), the loop's strategy over them and the
    validation prompts."""
    if spec.algorithm.prompts_per_step < ctx.world:
        raise ValueError(f"prompts_per_step={spec.algorithm.prompts_per_step} is below the {ctx.world} ranks: "
                         "a rank with no prompts would have no update to join")
    if spec.algorithm.dynamic_sampling:
        raise ValueError("algorithm.dynamic_sampling is not supported with resources.gpus > 1 yet")
    job = load_job(spec)
    algorithm, cfg, rank, world = resolve(spec.algorithm.algorithm_name), spec.algorithm, ctx.rank, ctx.world
    shards = StepShards()  # every rank's rollout summary of the step: the loss share and the harvest read it

    def deepspeed_loss_scale() -> float:  # DeepSpeed averages the ranks' gradients: undo it with x world
        return loss_share(algorithm, cfg, shards.last_gather, rank) * world

    # DeepSpeed (when the plan uses it) moves the weights into its flat buffers: before the engine captures them
    plan, ds = build_update(spec, job.model, job.device, loss_scale=deepspeed_loss_scale)
    updater: Updater
    update: DataParallelTorchUpdate | None = None
    if ds is None:
        updater = update = DataParallelTorchUpdate(job.model, cfg, plan, ctx, algorithm, shards)
    else:
        updater = ds
    # our engine (a vLLM job is one process: train.py), without tail training: per-rank training would diverge the
    # drafter copies (harvest.py)
    inner = make_rollout(spec, job.model, job.tokenizer, job.device, tail_training=False)
    drafter = inner.drafter
    harvester = Harvester(ctx, drafter, spec.drafter.max_train_steps_per_rl_step)
    rollout = ShardedRollout(inner, ctx, harvester, spec.seed + spec.rollout.seed, shards)
    hook = DistDrafterHook(ctx, drafter, shards.harvest_records) if drafter is not None else None
    trainer = GRPOTrainer(spec, job.model, job.tokenizer, rollout, job.train, job.reward_fns, device=job.device,
                          drafter=hook, reward_names=job.reward_names, updater=updater, algorithm=algorithm,
                          batch_sums=ctx.all_reduce_floats)  # batch-wide advantages see every rank's shard
    report_built(spec, job, trainer, reporter)
    return trainer, DataParallel(ctx, rollout, shards, update, drafter), job.val


def dist_step(trainer: GRPOTrainer, dp: DataParallel) -> tuple[dict[str, float], list[dict], list[dict[str, float]]]:
    """One RL step on every rank. Returns (this rank's metrics, its sample rows, every rank's metrics) with the
    gradient norm and loss of the data-parallel update in place of the trainer's local ones (DeepSpeed's norm is
    already global), and this rank's optimizer state size (divided across ranks by ZeRO) and, on CUDA, its peak
    memory."""
    metrics, samples, _ = trainer.step()
    metrics["perf/optimizer_state_mib"] = optimizer_state_bytes(trainer.optimizer) / 2**20
    if dp.ctx.device.type == "cuda":  # the allocator's high-water mark so far (KV cache, rollout and update)
        metrics["perf/peak_mem_mib"] = torch.cuda.max_memory_allocated(dp.ctx.device) / 2**20
    metrics["actor/pg_loss"] *= loss_share(trainer.algorithm, trainer.algo, dp.shards.last_gather, dp.ctx.rank)
    return metrics, samples, dp.ctx.all_gather_objects(metrics)
