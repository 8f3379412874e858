"""What DeepSpeed's partial optimizer offload (ZeRO-3, `offload_optimizer.ratio` < 1) leaves to its caller: the GPU
share of the optimizer state is stepped by a second optimizer of DeepSpeed's own (`backup_optimizer`, torch AdamW)
that neither follows the learning-rate schedule nor goes into DeepSpeed's checkpoints.

    sync_hyperparams(zero_optimizer, base)        # before each engine.step(): lr & co. from the scheduled optimizer
    torch.save(gpu_share_state(zero_optimizer), f) / load_gpu_share_state(zero_optimizer, torch.load(f))

DeepSpeed (stage3.py) builds the backup optimizer with the CPU optimizer's hyperparameters as floats at start, and
its state dict saves only the CPU optimizer's state: without these, the GPU share would keep the first step's
learning rate, and a resume would restart its Adam moments from zero.
"""

from __future__ import annotations

from typing import Any

import torch

HYPERPARAMS = ("lr", "betas", "eps", "weight_decay")


def backup_optimizer(zero_optimizer: Any) -> torch.optim.Optimizer | None:
    """The optimizer stepping the GPU share, or None without partial offload."""
    return getattr(zero_optimizer, "backup_optimizer", None)


def sync_hyperparams(zero_optimizer: Any, base: torch.optim.Optimizer) -> None:
    """The GPU share's optimizer := the scheduled one's lr, betas, eps and weight decay, group by group."""
    backup = backup_optimizer(zero_optimizer)
    if backup is None:
        return
    for dst, src in zip(backup.param_groups, base.param_groups, strict=True):
        for key in HYPERPARAMS:
            dst[key] = src[key]


def gpu_share_sub_groups(zero_optimizer: Any) -> list[int]:
    """Indices of the optimizer's sub-groups stepped on the accelerator (DeepSpeed's `subgroup_to_device`)."""
    return [i for i, dev in sorted(zero_optimizer.subgroup_to_device.items()) if dev != "cpu"]


def gpu_share_state(zero_optimizer: Any) -> dict[int, dict[str, torch.Tensor]]:
    """The GPU share's Adam state by sub-group index, on the host (empty before the first step)."""
    backup = backup_optimizer(zero_optimizer)
    if backup is None:
        return {}
    flat = zero_optimizer.fp32_partitioned_groups_flat
    return {i: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in backup.state[flat[i]].items()}
            for i in gpu_share_sub_groups(zero_optimizer) if flat[i] in backup.state}


def load_gpu_share_state(zero_optimizer: Any, state: dict[int, dict[str, torch.Tensor]]) -> None:
    """Put `gpu_share_state`'s output back onto the sub-groups' fp32 partitions (same layout: same model, ratio and
    world size, which DeepSpeed's own checkpoint requires too)."""
    backup = backup_optimizer(zero_optimizer)
    if backup is None:
        if state:
            raise ValueError("the checkpoint holds a GPU optimizer share, but this update offloads all of it")
        return
    flat = zero_optimizer.fp32_partitioned_groups_flat
    expected = set(gpu_share_sub_groups(zero_optimizer))
    if state and set(state) != expected:
        raise ValueError(f"the checkpoint's GPU optimizer share covers sub-groups {sorted(state)}, this update's "
                         f"{sorted(expected)}: was offload_ratio changed?")
    backup.state.clear()
    for i, st in state.items():
        p = flat[i]
        # torch AdamW keeps `step` on the host unless fused / capturable; the moments live with the parameter
        backup.state[p] = {k: v.to(p.device) if torch.is_tensor(v) and k != "step" else v for k, v in st.items()}
