"""The training loop of every job: steps to max_steps with stop requests, validation, reporting, checkpoints, exact
resume and the final export. How one step runs is a `StepStrategy`: `SingleDevice` here (one process), or
multigpu/data_parallel.py `DataParallel` (one rank of a data-parallel job; the same loop runs on every rank).

    trainer, val = build_trainer(spec, reporter)
    train_loop(spec, trainer, SingleDevice(), val, run_dir, reporter, resume=True)

Order per iteration, identical on every rank so a strategy's collectives line up: the stop decision, the step,
validation on `eval_steps`, the report (main process only), a checkpoint on `save_steps` and at max_steps. A stop
request ends the loop at the next safe point with a checkpoint of the last completed step (none when no step ran
since the resume) and no export. The main process writes checkpoints and exports; every process reads the same
checkpoint on resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from worker.tlt.config import JobSpec
from worker.tlt.data.prompts import RenderedPrompt
from worker.tlt.reporting import Reporter
from worker.tlt.rl.trainer import GRPOTrainer
from worker.tlt.run_dir import export_final, resume_from, save_checkpoint
from worker.tlt.sd_savings import SdSavings

StepResult = tuple[dict[str, float], list[dict], tuple[list[float], list[int]]]  # metrics, samples, (edges, counts)


class StepStrategy(Protocol):
    """How the loop's steps run: on one device, or as one rank of several in lock-step."""

    @property
    def is_main(self) -> bool:
        """Whether this process reports, writes checkpoints and exports."""
        ...

    @property
    def world(self) -> int:
        """Processes taking part in each step."""
        ...

    def resumed(self, trainer: GRPOTrainer, step: int) -> None:
        """Called once the checkpoint of `step` (0: none) is loaded, before the first step."""

    def should_stop(self, requested: bool) -> bool:
        """The stop decision from this process's request (every process must agree on it)."""
        ...

    def step(self, trainer: GRPOTrainer) -> StepResult:
        """One RL step; the metrics, samples and histogram are of the whole step (all processes)."""
        ...

    def before_checkpoint(self, trainer: GRPOTrainer) -> None:
        """Bring the state the main process writes together (every process calls it)."""

    def barrier(self) -> None:
        """Wait for every process (after a checkpoint and at the end)."""


class SingleDevice:
    """The trainer's own step in this process: nothing to agree on with anyone."""

    is_main = True
    world = 1

    def resumed(self, trainer: GRPOTrainer, step: int) -> None:
        pass

    def should_stop(self, requested: bool) -> bool:
        return requested

    def step(self, trainer: GRPOTrainer) -> StepResult:
        return trainer.step()

    def before_checkpoint(self, trainer: GRPOTrainer) -> None:
        pass

    def barrier(self) -> None:
        pass


def step_line(spec: JobSpec, step: int, metrics: dict[str, float], world: int) -> str:
    """The train.log line of one step (a loss that rounds to zero prints 0.0000, not -0.0000)."""
    ranks = f" ({world} ranks)" if world > 1 else ""
    harvest = f" harvest {metrics['harvest/ratio']:.2f}" if "harvest/ratio" in metrics else ""
    return (
        f"step {step}/{spec.max_steps}{ranks} reward {metrics['reward/mean']:.4f} "
        f"loss {round(metrics['actor/pg_loss'], 4) + 0.0:.4f} len {metrics['response_length/mean']:.1f} "
        f"step {metrics['timing_s/step']:.2f}s{harvest}"
    )


def train_loop(spec: JobSpec, trainer: GRPOTrainer, strategy: StepStrategy, val: list[RenderedPrompt],
               run_dir: Path, reporter: Reporter, resume: bool) -> None:
    """Steps `trainer` to spec.max_steps or a stop request (see the module docstring)."""
    ckpt_root = run_dir / "checkpoints"
    start = resume_from(trainer, ckpt_root) if resume else 0
    strategy.resumed(trainer, start)
    if start and strategy.is_main:
        reporter.log(f"resumed from checkpoint step-{start}")

    def checkpoint() -> None:
        strategy.before_checkpoint(trainer)
        if trainer.ds is not None:  # DeepSpeed's optimizer shards: every process writes its own, before step-N exists
            trainer.ds.save(ckpt_root, trainer.step_count)
        if strategy.is_main:
            path = save_checkpoint(trainer, ckpt_root, spec.save_total_limit)
            reporter.artifact("checkpoint", path, trainer.step_count)
        strategy.barrier()

    step = start
    savings = SdSavings()  # time SD saved in the tail, for the metrics and the closing line (since this start)
    while step < spec.max_steps:
        if strategy.should_stop(reporter.should_stop()):
            if strategy.is_main:
                reporter.log(f"stop requested: stopping after step {step}")
            if step > start:
                checkpoint()
            return
        metrics, samples, (edges, counts) = strategy.step(trainer)
        step = trainer.step_count
        if spec.eval_steps and step % spec.eval_steps == 0:
            metrics.update(trainer.validate(val))
        if strategy.is_main:
            metrics.update(savings.observe(metrics))
            reporter.metrics(step, metrics)
            reporter.histogram(step, "response_length", edges, counts)
            reporter.samples(step, samples)
            reporter.log(step_line(spec, step, metrics, strategy.world))
        if step % spec.save_steps == 0 or step == spec.max_steps:
            checkpoint()
    if strategy.is_main:
        policy = export_final(spec, trainer, run_dir, reporter, step)
        ranks = f" on {strategy.world} ranks" if strategy.world > 1 else ""
        reporter.log(f"done: {step} steps{ranks}; {savings.summary()}; policy exported to {policy}")
    strategy.barrier()
