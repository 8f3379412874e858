"""Multi-GPU jobs on real GPUs over NCCL (marked `gpu`: never run by CI). On a 2 x H200 host:

    NCCL_NVLS_ENABLE=0 python -m pytest -m gpu tests/multigpu -q -p no:cacheprovider   # python -m: imports tests.*

A whole 2-rank job of the tiny Llama in bf16 with adaptive SD and the online drafter: both ranks on their own GPU,
the gradient all-reduce over NCCL (fp32 master grads), the drafter broadcast of CUDA-resident state, rank 0's
merged metrics relayed to the job's reporter, replicas checked equal before the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.tlt.config import JobSpec
from worker.tlt.multigpu import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def test_two_gpu_job_with_drafter(tmp_path: Path) -> None:
    from tests.multigpu.ranks import Quiet  # `python -m pytest`: the repo root is on sys.path
    from tests.multigpu.test_multigpu_gloo import toy_spec

    spec = toy_spec(model={"dtype": "bfloat16"}, resources={"gpus": 2}, max_steps=3, save_steps=3,
                    rollout={"speculative": "adaptive", "sd_on_below": 8, "cuda_graphs": True},
                    algorithm={"max_completion_length": 32, "prompts_per_step": 4})
    rep = Quiet()
    launch.run(spec, tmp_path, rep)
    metrics = [args[1] for name, args in rep.calls if name == "metrics"]
    assert len(metrics) == 3
    for m in metrics:
        assert m["dist/world_size"] == 2 and m["actor/grad_norm"] > 0
        assert {"timeline/gpu0/rollout_s", "timeline/gpu1/rollout_s", "harvest/ratio"} <= m.keys()
    assert (tmp_path / "checkpoints" / "step-3").is_dir() and (tmp_path / "policy" / "config.json").exists()


def test_two_gpu_job_with_deepspeed_zero2_resumes(tmp_path: Path) -> None:
    """DeepSpeed ZeRO-2 on NCCL: bf16 policy with DeepSpeed's fp32 masters, fused AdamW over each GPU's partition,
    every rank's shard written as DeepSpeed's checkpoint beside step-N and resumed by both."""
    from tests.multigpu.ranks import Quiet
    from tests.multigpu.test_multigpu_gloo import toy_spec

    def spec(steps: int) -> JobSpec:
        return toy_spec(model={"dtype": "bfloat16"}, resources={"gpus": 2, "zero_stage": 2}, max_steps=steps,
                        save_steps=1, rollout={"speculative": "off", "cuda_graphs": True}, drafter={"kind": "none"},
                        algorithm={"max_completion_length": 32, "prompts_per_step": 4})

    launch.run(spec(1), tmp_path, Quiet())
    rep = Quiet()
    launch.run(spec(2), tmp_path, rep)
    assert any("resumed from checkpoint step-1" in args[0] for name, args in rep.calls if name == "log")
    (m,) = [args[1] for name, args in rep.calls if name == "metrics"]
    per_gpu = [m[f"perf/gpu{r}/optimizer_state_mib"] for r in range(2)]
    assert all(0.3 < s / sum(per_gpu) < 0.7 for s in per_gpu)  # each rank holds about half the AdamW moments
    assert m["perf/peak_mem_mib"] > 0 and m["actor/grad_norm"] > 0
    assert (tmp_path / "checkpoints" / "deepspeed" / "step-2").is_dir()
    assert not (tmp_path / "checkpoints" / "step-2" / "optimizer.pt").exists()
