"""The update plan (rl/update_plan.py): parameter counts match the built model, the spec's explicit choices win,
and on one H200 the arithmetic keeps SmolLM2 on the torch update and moves a 7B-class update to DeepSpeed ZeRO-3
with a share of the optimizer state on the host; the DeepSpeed config carries that share."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from worker.tlt.config import AlgorithmConfig, Resources
from worker.tlt.model.args import PRESETS, shape
from worker.tlt.model.transformer import Transformer
from worker.tlt.rl.deepspeed_update import SUB_GROUPS, ds_config
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
    whole_offload = plan(Resources(zero_stage=2, offload_optimizer=True), "qwen2.5-7b", gradient_checkpointing=True)
    assert whole_offload.gpu_bytes < whole_offload.gpu_budget and not whole_offload.fits  # the host is too small
    assert (big.engine, big.zero_stage, big.offload_optimizer) == ("deepspeed", 3, True) and big.fits
    assert 0.3 < big.offload_ratio < 0.6  # a share of the fp32 state on each side
    assert big.gpu_bytes < torch_big.gpu_bytes and big.host_bytes < whole_offload.host_bytes
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
    assert z2["bf16 gradient accumulation (whole parameters)"] == (2 * n, "host")
    z3 = memory_parts(n, w, 3, False, True, "deepspeed")
    assert sum(b for b, _ in z3.values()) == pytest.approx(2 * n / w + 2 * n + 2 * n + 16 * n / w)
    big = memory_parts(10**9, 1, 3, False, True, "deepspeed")
    assert big["bf16 gradients (reduce bucket)"] == (1e9, "gpu")  # a 5e8-element bucket, not the whole gradient
    plain = memory_parts(n, 1, 0, False, True, "torch")
    assert sum(b for b, _ in plain.values()) == 20 * n


def test_partial_offload_splits_the_fp32_state_by_the_ratio() -> None:
    n, w, r = 1000, 2, 0.25
    parts = memory_parts(n, w, 3, True, True, "deepspeed", ratio=r)
    gpu = sum(b for b, where in parts.values() if where == "gpu")
    host = sum(b for b, where in parts.values() if where == "host")
    assert gpu == pytest.approx(2 * n / w + 2 * n + 2 * n + (1 - r) * 16 * n / w)
    assert host == pytest.approx(4 * n / w + r * 16 * n / w)  # fp32 accumulation of every gradient + the share
    whole = memory_parts(n, w, 3, True, True, "deepspeed")
    assert sum(b for b, where in whole.values() if where == "host") == pytest.approx(20 * n / w)


def test_explicit_ratio_is_kept_and_the_config_carries_it() -> None:
    p = plan(Resources(offload_ratio=0.4), "qwen2.5-7b", gradient_checkpointing=True)
    assert (p.zero_stage, p.offload_optimizer, p.offload_ratio) == (3, True, 0.4) and p.fits
    assert not p.pin_host  # the pinned allocator's worst case would not fit this host: pageable
    n = count_params(shape("qwen2.5-7b"))
    cfg = ds_config(p, AlgorithmConfig(), low_precision=True, n_params=n)["zero_optimization"]
    assert cfg["stage"] == 3 and cfg["offload_optimizer"] == {"device": "cpu", "pin_memory": False, "ratio": 0.4}
    assert n / cfg["sub_group_size"] == pytest.approx(SUB_GROUPS, abs=1)  # a grain finer than the ratio steps
    whole = plan(Resources(offload_ratio=1.0), "qwen2.5-1.5b")
    assert (whole.offload_optimizer, whole.offload_ratio, whole.zero_stage) == (True, 1.0, 2) and whole.pin_host
    whole_cfg = ds_config(whole, AlgorithmConfig(), low_precision=True, n_params=10)["zero_optimization"]
    assert whole_cfg["offload_optimizer"] == {"device": "cpu", "pin_memory": True} and "sub_group_size" not in whole_cfg
    asked_whole = plan(Resources(zero_stage=3, offload_optimizer=True), "qwen2.5-7b", gradient_checkpointing=True)
    assert asked_whole.offload_ratio == 1.0 and not asked_whole.fits  # offload asked without a ratio: all of it


def test_no_ratio_fits_when_the_host_is_too_small() -> None:
    args = shape("qwen2.5-7b")
    p = plan_update(Resources(), AlgorithmConfig(gradient_checkpointing=True), args, count_params(args), world=1,
                    gpu_bytes=H200, host_bytes=32e9, low_precision=True)
    assert not p.fits and "does not fit" in p.lines()[-1]


def test_bad_resource_combinations_are_refused() -> None:
    with pytest.raises(ValidationError):
        Resources(update_engine="torch", zero_stage=2)
    with pytest.raises(ValidationError):
        Resources(offload_optimizer=True, zero_stage=0)
    with pytest.raises(ValidationError):
        Resources(zero_stage=4)  # type: ignore[arg-type]
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValidationError, match="offload_ratio"):
            Resources(offload_ratio=bad)
    with pytest.raises(ValidationError, match="zero_stage 3"):
        Resources(offload_ratio=0.5, zero_stage=2)
    with pytest.raises(ValidationError, match="offload_optimizer true or unset"):
        Resources(offload_ratio=0.5, offload_optimizer=False)
    with pytest.raises(ValidationError, match="update_engine"):
        Resources(offload_ratio=0.5, update_engine="torch")
    assert Resources(offload_ratio=1.0, zero_stage=2).offload_ratio == 1.0  # whole offload at any stage >= 1


def test_a_cpu_process_keeps_the_torch_update_under_auto() -> None:
    # the host is the "GPU" budget of a CPU job; a tight budget must not move a CPU run onto DeepSpeed's CPU path
    args = shape("qwen2.5-7b")
    cpu = plan_update(Resources(), AlgorithmConfig(), args, count_params(args), world=1, gpu_bytes=8 * 2**30,
                      host_bytes=8 * 2**30, low_precision=True, on_gpu=False)
    assert cpu.engine == "torch" and not cpu.fits
    asked = plan_update(Resources(zero_stage=2), AlgorithmConfig(), args, count_params(args), world=1,
                        gpu_bytes=8 * 2**30, host_bytes=8 * 2**30, low_precision=True, on_gpu=False)
    assert asked.engine == "deepspeed"  # an explicit request still wins
