"""What a training run keeps in its run directory besides the reporter's files: checkpoints/step-N (`save_checkpoint`,
`resume_from`: model, optimizer, scheduler, RNG and trainer state, plus the online drafter, the adaptive-SD
controller's bandit (`Rollout.sd_controller`, single- and multi-GPU alike) and the fp32 master weights when the job
has them) and the final exports (`export_final`: policy/ as an HF directory, drafter/ when the job trained one
online).
"""

from __future__ import annotations

from pathlib import Path

from worker.tlt.config import JobSpec
from worker.tlt.export.hf import export_policy
from worker.tlt.reporting import Reporter
from worker.tlt.rl.checkpoint import capture_rng, clean_partial, latest_checkpoint, load_checkpoint, restore_rng
from worker.tlt.rl.checkpoint import save_checkpoint as write_checkpoint
from worker.tlt.rl.trainer import GRPOTrainer


def save_checkpoint(trainer: GRPOTrainer, root: Path, keep: int) -> Path:
    extra: dict = {"drafter": trainer.drafter.state_dict()} if trainer.drafter is not None else {}
    if (ctl := trainer.rollout.sd_controller) is not None:
        extra["adaptive"] = ctl.state_dict()
    if trainer.master.pairs:  # the bf16 weights are these rounded: an exact resume needs the fp32 copies
        extra["master_weights"] = trainer.master.state_dict()
    return write_checkpoint(
        root, trainer.step_count, model=trainer.model,
        optimizer=trainer.optimizer if trainer.ds is None else None,  # DeepSpeed's: root/deepspeed (every rank)
        scheduler=trainer.scheduler,
        rng=capture_rng(trainer.generator), trainer_state=trainer.state_dict(), extra=extra, keep=keep,
    )


def resume_from(trainer: GRPOTrainer, root: Path) -> int:
    """Load the newest checkpoint under root into the trainer; returns its step (0 when there is none)."""
    clean_partial(root)
    path = latest_checkpoint(root)
    if path is None:
        return 0
    ck = load_checkpoint(path)
    trainer.model.load_state_dict(ck.model, strict=False)  # tied heads have no separate lm_head tensor
    if trainer.ds is not None:  # every rank reads its shard: fp32 master weights, moments, the weights they round to
        trainer.ds.load(root, ck.step)
    else:
        if "master_weights" in ck.extra:
            trainer.master.load_state_dict(ck.extra["master_weights"])
        else:  # a checkpoint written without master weights: start them from the loaded weights
            trainer.master.sync_from_model()
        trainer.optimizer.load_state_dict(ck.optimizer)
    trainer.scheduler.load_state_dict(ck.scheduler)
    trainer.load_state_dict(ck.trainer_state)
    restore_rng(ck.rng, trainer.generator)
    trainer.rollout.on_weights_updated()  # a rollout with its own copy of the weights (vLLM) loads them
    if trainer.drafter is not None and "drafter" in ck.extra:
        trainer.drafter.load_state_dict(ck.extra["drafter"])
    if (ctl := trainer.rollout.sd_controller) is not None and "adaptive" in ck.extra:
        ctl.load_state_dict(ck.extra["adaptive"])
    return ck.step


def export_final(spec: JobSpec, trainer: GRPOTrainer, run_dir: Path, reporter: Reporter, step: int) -> Path:
    """Export the policy (run_dir/policy) and the online drafter if any (run_dir/drafter), reporting each as an
    artifact of `step`; returns the policy directory."""
    policy = export_policy(
        trainer.model, trainer.tokenizer, run_dir / "policy",
        generation={"do_sample": True, "temperature": spec.algorithm.temperature, "top_p": spec.algorithm.top_p},
    )
    reporter.artifact("policy", policy, step)
    drafter_model = getattr(trainer.drafter, "train_drafter", None)  # the online EAGLE drafter, if any
    if drafter_model is not None:
        from worker.tlt.drafter.export import export_drafter

        drafter_dir = export_drafter(drafter_model, run_dir / "drafter", spec.drafter.export_kind)
        reporter.artifact("drafter", drafter_dir, step)
    return policy
