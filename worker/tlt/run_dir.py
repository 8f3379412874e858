"""What a training run keeps in its run directory besides the reporter's files: checkpoints/step-N (`save_checkpoint`,
`resume_from`: the policy's weights and every part the trainer names in `GRPOTrainer.checkpoint_parts`, through
rl/checkpoint.py's one interface: optimizer, LR schedule, RNG streams, trainer progress, fp32 master weights, the
online drafter, the SD controller's bandit and step costs, single- and multi-GPU alike; a DeepSpeed update's
optimizer shards are written by every rank, rl/loop.py) and the final exports (`export_final`: policy/ as an HF
directory, drafter/ when the job trained one online).
"""

from __future__ import annotations

from pathlib import Path

from worker.tlt.config import JobSpec
from worker.tlt.export.hf import export_policy
from worker.tlt.reporting import Reporter
from worker.tlt.rl.checkpoint import (
    OPTIMIZER,
    clean_partial,
    latest_checkpoint,
    load_checkpoint,
    restore_parts,
    save_parts,
)
from worker.tlt.rl.trainer import MASTER_WEIGHTS, GRPOTrainer


def save_checkpoint(trainer: GRPOTrainer, root: Path, keep: int) -> Path:
    return save_parts(root, trainer.step_count, model=trainer.model, parts=trainer.checkpoint_parts(), keep=keep)


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
    missing = restore_parts(ck, trainer.checkpoint_parts())
    if OPTIMIZER in missing:  # a torch update cannot continue exactly from another optimizer's checkpoint
        raise ValueError(f"checkpoint {path} holds no optimizer state (a DeepSpeed update's?); this job's update "
                         f"runs on torch: start over or resume with the same resources")
    if MASTER_WEIGHTS in missing:  # a checkpoint written without master weights: start them from the loaded weights
        trainer.master.sync_from_model()
    trainer.rollout.on_weights_updated()  # a rollout with its own copy of the weights (vLLM) loads them
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
        from worker.tlt.speculative.drafter.export import export_drafter

        drafter_dir = export_drafter(drafter_model, run_dir / "drafter", spec.drafter.export_kind)
        reporter.artifact("drafter", drafter_dir, step)
    return policy
