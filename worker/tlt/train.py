"""Run a TLT training job: `run(spec, run_dir, reporter)` (what the Celery worker calls) and `tlt train` (no service).

    tlt train spec.yaml [--run-dir DIR] [--preset NAME]
    python -m worker.tlt.train spec.yaml --run-dir runs/demo
    python -m worker.tlt.train --preset demo-cpu --run-dir runs/demo     # a named preset instead of a file

With `--preset` and a spec file, the file's keys override the preset's. The run directory receives metrics.jsonl,
histograms.jsonl, samples.jsonl, artifacts.jsonl, train.log (file_reporter.py), checkpoints/step-N and policy/ (the
HF export). A run directory that already holds checkpoints resumes from the newest one (resume=False starts over).
Stop a `tlt train` run at its next safe point with `touch DIR/STOP`.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

from worker.tlt.adaptive.controller import AdaptiveSd
from worker.tlt.config import PRESETS, JobSpec
from worker.tlt.data.dataset import BUILTIN_REWARDS, load_examples, split_examples
from worker.tlt.data.prompts import render_examples
from worker.tlt.export.hf import export_policy
from worker.tlt.file_reporter import FileReporter
from worker.tlt.model.load import load_model
from worker.tlt.reporting import Reporter
from worker.tlt.rewards.registry import resolve
from worker.tlt.rl.checkpoint import capture_rng, clean_partial, latest_checkpoint, load_checkpoint, restore_rng
from worker.tlt.rl.checkpoint import save_checkpoint as write_checkpoint
from worker.tlt.rl.engine_adapter import make_rollout
from worker.tlt.rl.trainer import GRPOTrainer

log = logging.getLogger(__name__)


def pick_device(spec: JobSpec) -> torch.device:
    if spec.resources.gpus > 0:
        if not torch.cuda.is_available():
            raise RuntimeError(f"the spec asks for {spec.resources.gpus} GPU(s) but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def reward_names_for(spec: JobSpec) -> list[str]:
    """The spec's reward functions; when it leaves them unset, the built-in dataset's own (toy-count: toy_count)."""
    algo, builtin = spec.algorithm, spec.dataset.builtin
    if "reward_funcs" not in algo.model_fields_set and builtin in BUILTIN_REWARDS:
        return list(BUILTIN_REWARDS[builtin])
    return list(algo.reward_funcs)


def build_trainer(spec: JobSpec, reporter: Reporter) -> tuple[GRPOTrainer, list]:
    """Model, data, rewards and rollout engine wired into a trainer; also returns the validation prompts."""
    device = pick_device(spec)
    seed_everything(spec.seed)
    model, tokenizer = load_model(spec.model, device)
    ds = spec.dataset
    rows = load_examples(ds)
    # held out whether or not eval is on, so the training rows (and their order) never depend on eval_steps
    train_rows, val_rows = split_examples(rows, ds.validation_size)
    train = render_examples(train_rows, tokenizer, ds.system_prompt, ds.max_prompt_length)
    val = render_examples(val_rows, tokenizer, ds.system_prompt, ds.max_prompt_length)
    if not train:
        raise ValueError(f"no training prompts fit max_prompt_length={ds.max_prompt_length}")
    reward_names = reward_names_for(spec)
    reward_fns = resolve(reward_names)
    rollout = make_rollout(spec, model, tokenizer, device)
    reporter.log(
        f"model {spec.model.model_dump(exclude_none=True)} on {device}; {len(train)} training prompts, "
        f"{len(val)} validation; rewards {reward_names}; rollout speculative={spec.rollout.speculative}"
    )
    trainer = GRPOTrainer(spec, model, tokenizer, rollout, train, reward_fns, device=device, drafter=rollout.drafter,
                          reward_names=reward_names)
    if model.head_weight.dtype != torch.float32 and not trainer.master.enabled:
        # one module serves rollout and training (free weight sync): without fp32 copies AdamW updates far below
        # a bf16 ulp are rounded away
        reporter.log(f"warning: training {model.head_weight.dtype} weights without fp32 master weights "
                     "(algorithm.fp32_master_weights: false); small updates are rounded away")
    return trainer, val


def _adaptive(trainer: GRPOTrainer) -> AdaptiveSd | None:
    """The rollout engine's SD controller, when the job runs adaptive SD (its bandit state is part of a resume)."""
    engine = getattr(trainer.rollout, "engine", None)
    return getattr(engine, "adaptive", None)


def save_checkpoint(trainer: GRPOTrainer, root: Path, keep: int) -> Path:
    extra: dict = {"drafter": trainer.drafter.state_dict()} if trainer.drafter is not None else {}
    if (ctl := _adaptive(trainer)) is not None:
        extra["adaptive"] = ctl.state_dict()
    if trainer.master.pairs:  # the bf16 weights are these rounded: an exact resume needs the fp32 copies
        extra["master_weights"] = trainer.master.state_dict()
    return write_checkpoint(
        root, trainer.step_count, model=trainer.model, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
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
    if "master_weights" in ck.extra:
        trainer.master.load_state_dict(ck.extra["master_weights"])
    else:  # a checkpoint written without master weights: start them from the loaded weights
        trainer.master.sync_from_model()
    trainer.optimizer.load_state_dict(ck.optimizer)
    trainer.scheduler.load_state_dict(ck.scheduler)
    trainer.load_state_dict(ck.trainer_state)
    restore_rng(ck.rng, trainer.generator)
    if trainer.drafter is not None and "drafter" in ck.extra:
        trainer.drafter.load_state_dict(ck.extra["drafter"])
    if (ctl := _adaptive(trainer)) is not None and "adaptive" in ck.extra:
        ctl.load_state_dict(ck.extra["adaptive"])
    return ck.step


def run_drafter_warmup(spec: JobSpec, run_dir: Path, reporter: Reporter) -> None:
    """`type: drafter` jobs: warm up a drafter on the dataset's prompts (drafter/warmup.py), export to run_dir/drafter."""
    device = pick_device(spec)
    seed_everything(spec.seed)
    model, tokenizer = load_model(spec.model, device)
    ds = spec.dataset
    train_rows, _ = split_examples(load_examples(ds), 0)
    prompts = render_examples(train_rows, tokenizer, ds.system_prompt, ds.max_prompt_length)
    reporter.log(f"drafter warm-up ({spec.drafter.kind}) for {spec.model.model_dump(exclude_none=True)} on {device}")
    from worker.tlt.drafter.warmup import warmup  # drafter code is imported only by jobs that use it

    warmup(spec, model, tokenizer, [list(p.ids) for p in prompts], reporter, out_dir=run_dir / "drafter")


def run(spec: JobSpec, run_dir: Path, reporter: Reporter, resume: bool = True) -> None:
    """Train `spec` to max_steps (or until reporter.should_stop()), checkpointing and exporting into run_dir.
    `type: drafter` jobs run the drafter warm-up instead."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if spec.type == "drafter":
        run_drafter_warmup(spec, run_dir, reporter)
        return
    if spec.resources.gpus > 1:
        from worker.tlt.multigpu import launch  # multi-GPU jobs only: one process per GPU

        launch.run(spec, run_dir, reporter, resume)
        return
    trainer, val = build_trainer(spec, reporter)
    try:
        train_loop(spec, trainer, val, run_dir, reporter, resume)
    finally:
        trainer.close()


def train_loop(spec: JobSpec, trainer: GRPOTrainer, val: list, run_dir: Path, reporter: Reporter,
               resume: bool) -> None:
    """Steps to max_steps with validation, checkpoints and the final export (see `run`)."""
    ckpt_root = run_dir / "checkpoints"
    start = resume_from(trainer, ckpt_root) if resume else 0
    if start:
        reporter.log(f"resumed from checkpoint step-{start}")
    step = start
    while step < spec.max_steps:
        if reporter.should_stop():
            reporter.log(f"stop requested: stopping after step {step}")
            if step > start:
                path = save_checkpoint(trainer, ckpt_root, spec.save_total_limit)
                reporter.artifact("checkpoint", path, step)
            return
        metrics, samples, (edges, counts) = trainer.step()
        step = trainer.step_count
        if spec.eval_steps and step % spec.eval_steps == 0:
            metrics.update(trainer.validate(val))
        reporter.metrics(step, metrics)
        reporter.histogram(step, "response_length", edges, counts)
        reporter.samples(step, samples)
        reporter.log(
            f"step {step}/{spec.max_steps} reward {metrics['reward/mean']:.4f} loss {metrics['actor/pg_loss']:.4f} "
            f"len {metrics['response_length/mean']:.1f} step {metrics['timing_s/step']:.2f}s"
        )
        if step % spec.save_steps == 0 or step == spec.max_steps:
            path = save_checkpoint(trainer, ckpt_root, spec.save_total_limit)
            reporter.artifact("checkpoint", path, step)
    policy = export_policy(
        trainer.model, trainer.tokenizer, run_dir / "policy",
        generation={"do_sample": True, "temperature": spec.algorithm.temperature, "top_p": spec.algorithm.top_p},
    )
    reporter.artifact("policy", policy, step)
    drafter_model = getattr(trainer.drafter, "train_drafter", None)  # the online EAGLE drafter, if any
    if drafter_model is not None:
        from worker.tlt.drafter.export import export_drafter

        drafter_dir = export_drafter(drafter_model, run_dir / "drafter")
        reporter.artifact("drafter", drafter_dir, step)
    reporter.log(f"done: {step} steps; policy exported to {policy}")


def merge_spec(base: dict, over: dict) -> dict:
    """`over` on top of `base`, section by section (a spec file's `algorithm:` keeps the preset's other keys)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge_spec(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_spec(path: str | None, preset_name: str | None) -> JobSpec:
    """A spec from a YAML file, a named preset, or the file's keys on top of the preset."""
    if preset_name and preset_name not in PRESETS:
        raise KeyError(f"unknown preset {preset_name!r}; known: {', '.join(PRESETS)}")
    data: dict = dict(PRESETS[preset_name]) if preset_name else {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a job spec is a mapping of JobSpec fields")
        data = merge_spec(data, loaded)
    return JobSpec.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tlt train", description="Run a TLT GRPO job without the service.")
    parser.add_argument("spec", nargs="?", help="job spec YAML (JobSpec fields)")
    parser.add_argument("--run-dir", default=None, help="output directory (default runs/<spec name>)")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS), help="start from a named preset")
    parser.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in the run directory")
    args = parser.parse_args(argv)
    if not args.spec and not args.preset:
        parser.error("give a spec file or --preset")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = load_spec(args.spec, args.preset)
    run_dir = Path(args.run_dir or f"runs/{spec.name}")
    run(spec, run_dir, FileReporter(run_dir), resume=not args.no_resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
