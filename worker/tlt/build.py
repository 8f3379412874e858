"""`build_trainer(spec, reporter)`: a job spec wired into a ready GRPO trainer (device, seeds, model, data split,
rewards, rollout engine); what `tlt train`, each multi-GPU rank and the training benches start from.

    trainer, val_prompts = build_trainer(JobSpec.model_validate(data), reporter)
"""

from __future__ import annotations

import random

import numpy as np
import torch

from worker.tlt.config import JobSpec
from worker.tlt.data.dataset import BUILTIN_REWARDS, load_examples, split_examples
from worker.tlt.data.prompts import render_examples
from worker.tlt.model.load import load_model
from worker.tlt.reporting import Reporter
from worker.tlt.rewards.registry import resolve
from worker.tlt.rl.deepspeed_update import build_update
from worker.tlt.rl.rollout_choice import build_rollout
from worker.tlt.rl.trainer import GRPOTrainer


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
    # DeepSpeed (when the plan uses it) moves the weights into its flat buffers: before anything captures them
    update = build_update(spec, model, device)
    rollout = build_rollout(spec, model, tokenizer, device)  # our engine or vLLM (rollout.backend)
    reporter.log(
        f"model {spec.model.model_dump(exclude_none=True)} on {device}; {len(train)} training prompts, "
        f"{len(val)} validation; rewards {reward_names}; rollout speculative={spec.rollout.speculative}"
    )
    trainer = GRPOTrainer(spec, model, tokenizer, rollout, train, reward_fns, device=device, drafter=rollout.drafter,
                          reward_names=reward_names, update=update)
    if model.head_weight.dtype != torch.float32 and not trainer.master.enabled and trainer.ds is None:
        # one module serves rollout and training (free weight sync): without fp32 copies AdamW updates far below
        # a bf16 ulp are rounded away
        reporter.log(f"warning: training {model.head_weight.dtype} weights without fp32 master weights "
                     "(algorithm.fp32_master_weights: false); small updates are rounded away")
    return trainer, val
