"""ZeRO-3 with partial optimizer offload (`resources.offload_ratio`, rl/partial_offload.py) in a CPU process over
gloo, tiny fp32 Llama, toy-count, with a learning-rate warm-up so the rate changes between steps: two updates give
the weights of the torch AdamW update (both shares of the optimizer state follow the schedule), and a resume from
the checkpoint after the first continues exactly (the GPU share's Adam state, which DeepSpeed's checkpoint leaves
out, is saved beside it).

On the CPU accelerator DeepSpeed names every sub-group's device "cpu" and steps them all with CPU Adam; the test
names the GPU share's sub-groups "cuda" after the engine starts, which routes them to DeepSpeed's second optimizer
as on a GPU (stage3.py `_optimizer_step`; the tensors stay on the host).
DeepSpeed's CPU Adam JIT-builds on first use (cached in ~/.cache/torch_extensions, a few minutes once).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch

from tests.multigpu.ranks import Quiet, params_of, spawn_ranks
from tests.multigpu.test_multigpu_deepspeed import assert_close, batches, toy_spec
from worker.tlt.build import build_trainer
from worker.tlt.config import JobSpec
from worker.tlt.rl.partial_offload import backup_optimizer, gpu_share_sub_groups
from worker.tlt.run_dir import resume_from, save_checkpoint

pytestmark = pytest.mark.slow
RATIO = 0.5
WARMUP = {"warmup_steps": 1}  # lr x 0.5, then x 1: a share left on the first rate drifts from the reference


def partial_spec() -> JobSpec:
    spec = toy_spec({"update_engine": "deepspeed", "zero_stage": 3, "offload_ratio": RATIO})
    return spec.model_copy(update={"algorithm": spec.algorithm.model_copy(update=WARMUP)})


def partial_trainer() -> Any:
    trainer, _ = build_trainer(partial_spec(), Quiet())  # type: ignore[arg-type]
    zero = trainer.ds.engine.optimizer
    n = len(zero.fp32_partitioned_groups_flat)
    for i in range(int((1 - RATIO) * n)):  # DeepSpeed's split: the first sub-groups stay on the accelerator
        zero.subgroup_to_device[i] = "cuda"
    return trainer


def _one_rank(rank: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    url = urlparse(init_method)
    os.environ.update(MASTER_ADDR=str(url.hostname), MASTER_PORT=str(url.port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    root = Path(out_dir) / "checkpoints"
    first, second = batches()
    trainer = partial_trainer()
    zero = trainer.ds.engine.optimizer
    out: dict[str, Any] = {"ratio": trainer.plan.offload_ratio, "on_gpu": gpu_share_sub_groups(zero),
                           "sub_groups": len(zero.fp32_partitioned_groups_flat), "lr": []}
    for b, seqs in enumerate((first, second)):
        scheduled = trainer.optimizer.param_groups[0]["lr"]  # the rate of this update (the schedule steps after it)
        trainer.model.eval()  # as the rollout engine leaves it
        trainer.ds.train_model.eval()
        trainer.update(seqs)
        out[f"train_mode/{b}"] = trainer.ds.train_model.training
        trainer.sync_weights()
        out[f"params/{b}"] = params_of(trainer.model)
        out["lr"].append((backup_optimizer(zero).param_groups[0]["lr"], scheduled))
        if b == 0:  # as rl/loop.py after a step: DeepSpeed's shards, then checkpoints/step-N
            trainer.step_count += 1  # what trainer.step() counts after its update
            trainer.ds.save(root, trainer.step_count)
            save_checkpoint(trainer, root, keep=2)
    trainer.close()
    out["share"] = torch.load(root / "deepspeed" / "step-1" / "gpu_optimizer_share_rank0.pt")
    resumed = partial_trainer()
    out["resumed_step"] = resume_from(resumed, root)
    resumed.update(second)
    resumed.sync_weights()
    out["resumed/1"] = params_of(resumed.model)
    resumed.close()
    torch.save(out, Path(out_dir) / "rank0.pt")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    (res,) = spawn_ranks(_one_rank, tmp_path_factory.mktemp("partial"), 1)
    return res


def test_partial_offload_splits_the_state_and_matches_the_torch_update(result: dict[str, Any]) -> None:
    assert result["ratio"] == RATIO
    n = result["sub_groups"]
    assert n >= 4 and result["on_gpu"] == list(range(n // 2))  # both optimizers step a share
    trainer, _ = build_trainer(toy_spec({"update_engine": "torch"}).model_copy(
        update={"algorithm": partial_spec().algorithm}), Quiet())  # type: ignore[arg-type]
    for b, seqs in enumerate(batches()):
        trainer.update(seqs)
        assert_close(result[f"params/{b}"], params_of(trainer.model), atol=5e-5)  # lr 2e-2: moves of ~1e-2 a step
    trainer.close()
    (gpu0, cpu0), (gpu1, cpu1) = result["lr"]
    assert gpu0 == cpu0 and gpu1 == cpu1 and gpu0 != gpu1  # the GPU share followed the schedule as it moved


def test_the_zero3_copy_trains_in_train_mode(result: dict[str, Any]) -> None:
    """Gradient checkpointing engages only in train mode: the copy must not keep the rollout engine's eval mode."""
    assert result["train_mode/0"] and result["train_mode/1"]


def test_partial_offload_resumes_exactly(result: dict[str, Any]) -> None:
    assert result["resumed_step"] == 1
    share = result["share"]
    assert sorted(share) == result["on_gpu"] and all("exp_avg_sq" in st for st in share.values())
    assert_close(result["resumed/1"], result["params/1"], atol=0.0)
