"""Optimizer, learning-rate schedule and fp32 master weights of the policy update.

    master = MasterWeights(trainable_params(model), enabled=use_master_weights(model, spec.algorithm))
    opt = build_optimizer(master.train_params, spec.algorithm)
    sched = build_scheduler(opt, spec.algorithm, total_steps=spec.max_steps)
    ... loss.backward(); master.accumulate_grads()     # per micro-batch
    ... clip(master.train_params); opt.step(); master.write_back(); sched.step()   # once per RL step

Master weights: the rollout engine reads the very bf16 parameters being trained (colocated, no weight copy), and
AdamW's update of a bf16 weight is rounded to bf16: an update below half a bf16 ulp (2^-9 relative, so 1e-6 on a
weight of 0.01 and above) is lost every step, however many steps push the same way. With master weights on,
the optimizer owns an fp32 copy of each low-precision parameter; gradients are accumulated into the copy in fp32
(micro-batches added in fp32, clipping in fp32), the step runs on the copy, and the copy is written back into the
bf16 parameter in place (same storage, so captured CUDA graphs keep reading the live weights). fp32 parameters are
trained directly either way. Cost: 4 bytes per parameter plus an fp32 gradient (SmolLM2-135M: about 1 GB).

The schedule multiplies the base learning rate: warmup rises linearly from 1/(warmup+1) to 1 over `warmup_steps`;
then "constant" stays at 1, "linear" falls to 0 at `total_steps`, "cosine" follows half a cosine to 0 (as the
transformers schedules of the same names).
"""

from __future__ import annotations

import math
from typing import Any

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


LOW_PRECISION = (torch.bfloat16, torch.float16)


def trainable_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]  # tied weights appear once


def use_master_weights(model: torch.nn.Module, algo: AlgorithmConfig) -> bool:
    """The spec's choice; unset (None) = on exactly when some trainable parameter is bf16 or fp16."""
    if algo.fp32_master_weights is not None:
        return algo.fp32_master_weights
    return any(p.dtype in LOW_PRECISION for p in trainable_params(model))


class MasterWeights:
    """fp32 copies of the low-precision parameters in `params` (see the module docstring). `train_params` is what
    the optimizer and grad clipping see: the fp32 copy where there is one, the parameter itself otherwise.
    Disabled, it is a pass-through (train_params == params, the other methods do nothing)."""

    def __init__(self, params: list[torch.nn.Parameter], enabled: bool) -> None:
        self.params = params
        self.enabled = enabled
        self.train_params: list[torch.nn.Parameter] = [
            torch.nn.Parameter(p.detach().float().clone()) if enabled and p.dtype in LOW_PRECISION else p
            for p in params
        ]
        self.pairs = [(p, m) for p, m in zip(params, self.train_params, strict=True) if m is not p]

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Move the parameters' gradients (from one backward) into the fp32 copies' gradients, summing in fp32."""
        for p, m in self.pairs:
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """After optimizer.step(): round the fp32 copies into the live low-precision parameters, in place."""
        for p, m in self.pairs:
            p.copy_(m)

    @torch.no_grad()
    def sync_from_model(self) -> None:
        """Re-seed the fp32 copies from the parameters (after loading weights that came without master copies)."""
        for p, m in self.pairs:
            m.copy_(p)

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"fp32": [m.detach().cpu() for _, m in self.pairs]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        saved = state["fp32"]
        if len(saved) != len(self.pairs):
            raise ValueError(f"checkpoint has {len(saved)} master tensors, this model {len(self.pairs)}")
        for (_, m), t in zip(self.pairs, saved, strict=True):
            m.copy_(t)


def adamw_kwargs(params: list[torch.nn.Parameter], algo: AlgorithmConfig) -> dict[str, Any]:
    """AdamW's hyper-parameters: fused on CUDA (one kernel over all tensors, step counters on the device, so the
    step never waits on the host), the multi-tensor (foreach) path on CPU. Shared with the DeepSpeed update
    (rl/deepspeed_update.py), which hands DeepSpeed an AdamW built with them."""
    on_cuda = bool(params) and all(p.is_cuda for p in params)
    return {"lr": algo.learning_rate, "weight_decay": algo.weight_decay,
            "fused": True if on_cuda else None, "foreach": None if on_cuda else True}


def build_optimizer(params: list[torch.nn.Parameter], algo: AlgorithmConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **adamw_kwargs(params, algo))


def build_scheduler(opt: torch.optim.Optimizer, algo: AlgorithmConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    kind, warmup = algo.lr_scheduler_type, algo.warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, kind, warmup, total_steps))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-parameter optimizer state (Adam's exp_avg, exp_avg_sq) this process holds: under DeepSpeed's
    ZeRO the optimizer steps this rank's partition only, so it holds 1/world of the moments."""
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() if st
               for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
