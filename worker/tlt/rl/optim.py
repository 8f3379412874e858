"""Optimizer and learning-rate schedule of the policy update: AdamW and a warmup + constant/linear/cosine schedule.

    opt = build_optimizer(model, spec.algorithm)
    sched = build_scheduler(opt, spec.algorithm, total_steps=spec.max_steps)
    ... opt.step(); sched.step()   # once per RL step

The schedule multiplies the base learning rate: warmup rises linearly from 1/(warmup+1) to 1 over `warmup_steps`;
then "constant" stays at 1, "linear" falls to 0 at `total_steps`, "cosine" follows half a cosine to 0 (as the
transformers schedules of the same names).
"""

from __future__ import annotations

import math

import torch

from worker.tlt.config import AlgorithmConfig


def lr_factor(step: int, kind: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base learning rate for the update of RL step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler_type {kind!r}")


def build_optimizer(model: torch.nn.Module, algo: AlgorithmConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach=False: the per-parameter path gives bit-identical results after a reload (resume exactness).
    return torch.optim.AdamW(params, lr=algo.learning_rate, weight_decay=algo.weight_decay, foreach=False)


def build_scheduler(opt: torch.optim.Optimizer, algo: AlgorithmConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    kind, warmup = algo.lr_scheduler_type, algo.warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, kind, warmup, total_steps))
