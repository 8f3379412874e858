"""What each rank of a multi-GPU job runs: build the single-GPU trainer (build.py `build_trainer`), apply data
parallelism to it from outside, and step it in lock-step with the other ranks.

    trainer, val = build_trainer(spec, reporter)
    dp = apply_data_parallel(trainer, ctx)           # sharded rollout + harvest + DP update (+ ZeRO-1) + drafter
    dist_train_loop(spec, trainer, dp, val, run_dir, reporter, ctx, resume=True)

Every rank runs every collective in the same order: the step (rollout gather, gradient all-reduce, drafter
broadcast), the metric gather, the stop decision (an all-reduce, so a cancel seen by one rank stops all at the same
step), validation (sharded, gathered). Rank 0 reports and writes checkpoints and exports; all ranks read the same
checkpoint on resume, and `check_replicas` proves the policies identical before each save.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker.tlt.config import JobSpec
from worker.tlt.multigpu.context import DistContext
from worker.tlt.multigpu.harvest import DistDrafterHook, Harvester
from worker.tlt.multigpu.metrics import merge_step_metrics
from worker.tlt.multigpu.rollout_shard import ShardedRollout
from worker.tlt.multigpu.update import DataParallelUpdate, check_replicas, loss_share
from worker.tlt.multigpu.zero import consolidate, optimizer_state_bytes, shard_optimizer
from worker.tlt.reporting import Reporter
from worker.tlt.rl.trainer import GRPOTrainer
from worker.tlt.run_dir import resume_from, save_checkpoint

if TYPE_CHECKING:
    from worker.tlt.drafter.online import OnlineDrafter


@dataclass
class DataParallel:
    """The pieces `apply_data_parallel` installed on a trainer."""

    ctx: DistContext
    rollout: ShardedRollout
    update: DataParallelUpdate
    drafter: OnlineDrafter | None


def apply_data_parallel(trainer: GRPOTrainer, ctx: DistContext) -> DataParallel:
    """Turn a single-GPU trainer into one rank of a data-parallel job, in place (see the package docstring)."""
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
    if drafter is not None:
        trainer.drafter = DistDrafterHook(ctx, drafter, rollout)
    if spec.resources.zero_stage == 1:
        shard_optimizer(trainer)  # before the update's hook goes on the optimizer
    update = DataParallelUpdate(ctx, trainer, rollout)
    return DataParallel(ctx, rollout, update, drafter)


def dist_step(trainer: GRPOTrainer, dp: DataParallel) -> tuple[dict[str, float], list[dict], list[dict[str, float]]]:
    """One RL step on every rank. Returns (this rank's metrics, its sample rows, every rank's metrics) with the
    gradient norm and loss of the data-parallel update in place of the trainer's local ones, and this rank's
    optimizer state size (halved per rank by ZeRO-1 on 2 ranks) and, on CUDA, its peak memory."""
    metrics, samples, _ = trainer.step()
    metrics["perf/optimizer_state_mib"] = optimizer_state_bytes(trainer.optimizer) / 2**20
    if dp.ctx.device.type == "cuda":  # the allocator's high-water mark so far (KV cache, rollout and update)
        metrics["perf/peak_mem_mib"] = torch.cuda.max_memory_allocated(dp.ctx.device) / 2**20
    metrics["actor/grad_norm"] = dp.update.last_grad_norm
    metrics["actor/pg_loss"] *= loss_share(trainer.loss_cfg.loss_type, dp.rollout.last_gather, dp.ctx.rank)
    return metrics, samples, dp.ctx.all_gather_objects(metrics)


def dist_train_loop(spec: JobSpec, trainer: GRPOTrainer, dp: DataParallel, val: list, run_dir: Path,
                    reporter: Reporter, resume: bool) -> None:
    """train.py's loop for one rank of a multi-GPU job (see the module docstring)."""
    ctx = dp.ctx
    ckpt_root = run_dir / "checkpoints"
    start = resume_from(trainer, ckpt_root) if resume else 0
    dp.rollout.calls = start  # one training rollout per step: the per-rank sampling seeds continue where they were
    check_replicas(ctx, trainer.model)
    if start and ctx.is_main:
        reporter.log(f"resumed from checkpoint step-{start}")
    step = start

    def checkpoint() -> None:
        check_replicas(ctx, trainer.model)
        consolidate(trainer.optimizer)  # ZeRO-1: every rank sends its shard of the AdamW state to rank 0
        if ctx.is_main:
            path = save_checkpoint(trainer, ckpt_root, spec.save_total_limit)
            reporter.artifact("checkpoint", path, step)
        ctx.barrier()

    while step < spec.max_steps:
        if ctx.any(reporter.should_stop()):
            if ctx.is_main:
                reporter.log(f"stop requested: stopping after step {step}")
            if step > start:
                checkpoint()
            return
        metrics, samples, per_rank = dist_step(trainer, dp)
        step = trainer.step_count
        val_metrics = trainer.validate(val) if spec.eval_steps and step % spec.eval_steps == 0 else {}
        if ctx.is_main:
            merged, (edges, counts) = merge_step_metrics(per_rank, dp.rollout.last_gather, spec.algorithm)
            merged.update(val_metrics)
            reporter.metrics(step, merged)
            reporter.histogram(step, "response_length", edges, counts)
            reporter.samples(step, samples)
            reporter.log(
                f"step {step}/{spec.max_steps} ({ctx.world} ranks) reward {merged['reward/mean']:.4f} "
                f"loss {merged['actor/pg_loss']:.4f} len {merged['response_length/mean']:.1f} "
                f"step {merged['timing_s/step']:.2f}s harvest {merged.get('harvest/ratio', 0.0):.2f}"
            )
        if step % spec.save_steps == 0 or step == spec.max_steps:
            checkpoint()
    if ctx.is_main:
        export(spec, trainer, dp, run_dir, reporter, step)
    ctx.barrier()


def export(spec: JobSpec, trainer: GRPOTrainer, dp: DataParallel, run_dir: Path, reporter: Reporter,
           step: int) -> None:
    """Rank 0: the policy (HF directory) and the drafter, as train.py exports them."""
    from worker.tlt.export.hf import export_policy

    policy = export_policy(
        trainer.model, trainer.tokenizer, run_dir / "policy",
        generation={"do_sample": True, "temperature": spec.algorithm.temperature, "top_p": spec.algorithm.top_p},
    )
    reporter.artifact("policy", policy, step)
    if dp.drafter is not None:
        from worker.tlt.drafter.export import export_drafter

        reporter.artifact("drafter", export_drafter(dp.drafter.train_drafter, run_dir / "drafter"), step)
    reporter.log(f"done: {step} steps on {dp.ctx.world} ranks; policy exported to {policy}")
