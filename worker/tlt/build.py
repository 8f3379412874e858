"""`build_trainer(spec, reporter)`: a job spec wired into a ready GRPO trainer for one process; what `tlt train` and
the training benches start from. It chooses the step's parts (rl/trainer.py: rollout, algorithm, updater, drafter
hook) and hands them to the trainer; multigpu/data_parallel.py `build_rank` chooses a rank's parts from the same
`load_job`.

    trainer, val_prompts = build_trainer(JobSpec.model_validate(data), reporter)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from worker.tlt.config import JobSpec
from worker.tlt.data.dataset import BUILTIN_REWARDS, load_examples, split_examples
from worker.tlt.data.prompts import RenderedPrompt, render_examples
from worker.tlt.model.load import load_model
from worker.tlt.model.tokenizer import TokenizerLike
from worker.tlt.model.transformer import Transformer
from worker.tlt.reporting import Reporter
from worker.tlt.rewards.registry import RewardFn, resolve
from worker.tlt.rl.algorithms.registry import resolve as resolve_algorithm
from worker.tlt.rl.engine_adapter import make_rollout
from worker.tlt.rl.rollout_io import Rollout
from worker.tlt.rl.trainer import DrafterHook, GRPOTrainer
from worker.tlt.rl.updater import build_updater


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


@dataclass
class Job:
    """What every process of a job loads the same way before choosing its step's parts."""

    device: torch.device
    model: Transformer
    tokenizer: TokenizerLike
    train: list[RenderedPrompt]
    val: list[RenderedPrompt]
    reward_names: list[str]
    reward_fns: list[RewardFn]


def load_job(spec: JobSpec) -> Job:
    """Device, seeds, model, the data split and the reward functions of `spec`."""
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
    return Job(device, model, tokenizer, train, val, reward_names, resolve(reward_names))


def report_built(spec: JobSpec, job: Job, trainer: GRPOTrainer, reporter: Reporter) -> None:
    """The job log's line on what was built, and a warning where small updates would be rounded away."""
    reporter.log(
        f"model {spec.model.model_dump(exclude_none=True)} on {job.device}; {len(job.train)} training prompts, "
        f"{len(job.val)} validation; rewards {job.reward_names}; rollout speculative={spec.rollout.speculative}"
    )
    if job.model.head_weight.dtype != torch.float32 and not trainer.master.enabled and trainer.ds is None:
        # one module serves rollout and training (free weight sync): without fp32 copies AdamW updates far below
        # a bf16 ulp are rounded away
        reporter.log(f"warning: training {job.model.head_weight.dtype} weights without fp32 master weights "
                     "(algorithm.fp32_master_weights: false); small updates are rounded away")


def build_rollout(spec: JobSpec, job: Job) -> tuple[Rollout, DrafterHook | None]:
    """The rollout backend (rl/rollout_io.py `Rollout`) of a one-process job and the drafter it drafts with and feeds,
    if any: our engine (drafter tail training between its tail steps) or vLLM (`rollout.backend`). A rank of a
    multi-GPU job runs our engine without tail training (multigpu/data_parallel.py `build_rank`)."""
    if spec.rollout.backend == "vllm":  # vLLM, imported only by the jobs that ask for it
        from worker.tlt.rollout_vllm.rollout import make_vllm_rollout

        vllm = make_vllm_rollout(spec, job.model, job.tokenizer, job.device)
        return vllm, vllm.drafter
    rollout = make_rollout(spec, job.model, job.tokenizer, job.device)
    return rollout, rollout.drafter


def build_trainer(spec: JobSpec, reporter: Reporter) -> tuple[GRPOTrainer, list[RenderedPrompt]]:
    """One process's trainer: the spec's updater, its rollout (with the drafter's tail training in the engine) and
    algorithm, the rollout's drafter as the drafter hook; also returns the validation prompts."""
    job = load_job(spec)
    if spec.rollout.backend == "vllm":  # vLLM holds its own weights; its drafter learns from the update's forward
        rollout, drafter = build_rollout(spec, job)
        updater = build_updater(spec, job.model, job.device, capture=getattr(drafter, "update_capture", None))
    else:  # DeepSpeed (when the plan uses it) moves the weights into its flat buffers: before the engine reads them
        updater = build_updater(spec, job.model, job.device)
        rollout, drafter = build_rollout(spec, job)
    trainer = GRPOTrainer(spec, job.model, job.tokenizer, rollout, job.train, job.reward_fns, device=job.device,
                          drafter=drafter, reward_names=job.reward_names, updater=updater,
                          algorithm=resolve_algorithm(spec.algorithm.algorithm_name))
    report_built(spec, job, trainer, reporter)
    return trainer, job.val
