"""The update plan (rl/update_plan.py): parameter counts match the built model, the spec's explicit choices win,
and on one H200 the arithmetic keeps SmolLM2 on the torch update and moves a 7B-class update to DeepSpeed."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from worker.tlt.config import AlgorithmConfig, Resources
from worker.tlt.model.args import PRESETS, shape
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.update_plan import count_params, memory_parts, plan_update

H200, HOST = 150e9, 137e9  # bytes: the GPU and host of the benchmark machine


@pytest.mark.parametrize("name", ["tiny-llama", "smollm2-135m", "shape:qwen2.5-7b", "shape:qwen3-8b",
                                  "shape:llama3.2-3b"])
def test_count_params_matches_the_model(name: str) -> None:
    args = shape(name[6:]) if name.startswith("shape:") else PRESETS[name]
    with torch.device("meta"):
        model = Transformer(args)
    assert count_params(args) == sum(p.numel() for p in model.parameters())


def plan(res: Resources, name: str, world: int = 1, installed: bool = True, **algo: object):
    args = shape(name)
    return plan_update(res, AlgorithmConfig(**algo), args, count_params(args), world=world, gpu_bytes=H200,
                       host_bytes=HOST, low_precision=True, deepspeed_installed=installed)


def test_small_model_stays_on_torch_and_large_moves_to_deepspeed() -> None:
    small = plan(Resources(), "qwen2.5-1.5b")
    assert (small.engine, small.zero_stage, small.offload_optimizer) == ("torch", 0, False) and small.fits
    big = plan(Resources(), "qwen2.5-7b", gradient_checkpointing=True)
    torch_big = plan(Resources(update_engine="torch"), "qwen2.5-7b", gradient_checkpointing=True)
    assert not torch_big.fits  # 20 bytes per parameter on one GPU
    assert big.engine == "deepspeed" and big.offload_optimizer and big.zero_stage == 2
    assert big.gpu_bytes < torch_big.gpu_bytes / 2  # the fp32 state left for the host
    two = plan(Resources(), "qwen2.5-7b", world=2, gradient_checkpointing=True)
    assert two.engine == "deepspeed" and not two.offload_optimizer and two.fits  # sharded over 2 GPUs instead


def test_explicit_choices_win_and_deepspeed_missing_means_torch() -> None:
    p = plan(Resources(zero_stage=3, offload_optimizer=False), "qwen2.5-1.5b", world=4)
    assert (p.engine, p.zero_stage, p.offload_optimizer) == ("deepspeed", 3, False)
    assert plan(Resources(), "qwen2.5-7b", installed=False).engine == "torch"
    assert plan(Resources(update_engine="deepspeed"), "qwen2.5-1.5b").zero_stage == 1  # DeepSpeed's bf16 optimizer


def test_memory_parts_follow_the_table() -> None:
    n, w = 1000, 4
    z1 = memory_parts(n, w, 1, False, True, "deepspeed")
    assert z1["fp32 master weights"] == (4 * n / w, "gpu") and z1["bf16 gradients"] == (2 * n, "gpu")
    z2 = memory_parts(n, w, 2, True, True, "deepspeed")
    assert z2["bf16 gradients"] == (2 * n / w, "gpu") and z2["Adam moments"] == (8 * n / w, "host")
    z3 = memory_parts(n, w, 3, False, True, "deepspeed")
    assert sum(b for b, _ in z3.values()) == pytest.approx(2 * n + 16 * n / w + 2 * n / w + 2 * n / w)
    plain = memory_parts(n, 1, 0, False, True, "torch")
    assert sum(b for b, _ in plain.values()) == 20 * n


def test_bad_resource_combinations_are_refused() -> None:
    with pytest.raises(ValidationError):
        Resources(update_engine="torch", zero_stage=2)
    with pytest.raises(ValidationError):
        Resources(offload_optimizer=True, zero_stage=0)
    with pytest.raises(ValidationError):
        Resources(zero_stage=4)  # type: ignore[arg-type]
