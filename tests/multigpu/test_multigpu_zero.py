"""ZeRO stage 1 (`resources.zero_stage: 1`, worker/tlt/multigpu/zero.py) on 2 CPU processes over gloo, tiny Llama:
- two data-parallel updates with the AdamW state sharded give the weights of the replicated update (global clip on);
- each rank holds about half the AdamW moments, reported as perf/optimizer_state_mib (and per rank);
- the consolidated state equals the replicated optimizer's; loading it restores each rank's shard, and an update
  after that load equals the uninterrupted one; a launched job checkpoints and resumes to the same weights and
  optimizer state as an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.multigpu.ranks import Quiet, params_of, spawn_ranks
from worker.tlt.build import build_trainer
from worker.tlt.config import JobSpec
from worker.tlt.multigpu import launch
from worker.tlt.multigpu.context import DistContext
from worker.tlt.multigpu.data_parallel import apply_data_parallel, dist_step
from worker.tlt.multigpu.harvest import HarvestRecord
from worker.tlt.multigpu.metrics import merge_step_metrics
from worker.tlt.multigpu.rollout_shard import ShardSummary, shard_bounds
from worker.tlt.multigpu.update import DataParallelUpdate
from worker.tlt.multigpu.zero import ShardedAdamW, consolidate, optimizer_state_bytes, shard_optimizer
from worker.tlt.rl.batch import UpdateSeq
from worker.tlt.rl.trainer import GRPOTrainer

pytestmark = pytest.mark.slow
WORLD = 2


def toy_spec(zero_stage: int, **over: Any) -> JobSpec:
    return JobSpec.model_validate({
        "name": "toy-zero",
        "model": {"builtin": "tiny-llama"},
        "dataset": {"builtin": "toy-count", "system_prompt": None, "validation_size": 0, "max_prompt_length": 64},
        "algorithm": {"num_generations": 4, "prompts_per_step": 2, "max_completion_length": 6,
                      "learning_rate": 2e-2, "max_grad_norm": 0.05, "reward_funcs": ["toy_count"]},
        "rollout": {"speculative": "off", "kv_cache_gb": 0.05},
        "drafter": {"kind": "none"},
        "resources": {"zero_stage": zero_stage},
        "max_steps": 2, "save_steps": 1, "save_total_limit": 2,
        **over,
    })



def batches() -> list[list[UpdateSeq]]:
    """Two fixed batches of 6 ragged sequences (the same in every process)."""
    g = torch.Generator().manual_seed(3)
    return [[UpdateSeq(torch.randint(3, 200, (4 + i % 3,), generator=g).tolist(),
                       torch.randint(3, 200, (1 + 2 * i,), generator=g).tolist(), float((i + b) % 3) - 1.0, None)
             for i in range(6)] for b in range(2)]


def dp_trainer(ctx: DistContext, zero_stage: int) -> GRPOTrainer:
    """A fresh trainer (same weights on every rank) with the DP update over a fixed 2-rank split of 6 sequences."""
    trainer, _ = build_trainer(toy_spec(zero_stage), Quiet())  # type: ignore[arg-type]
    if zero_stage:
        shard_optimizer(trainer)
    lengths = [len(s.response_ids) for s in batches()[0]]
    summaries = [ShardSummary(r, lengths[slice(*shard_bounds(6, r, WORLD))], [False] * 3,
                              HarvestRecord(r, 0.0, 0.0, 0.0, 0, {})) for r in range(WORLD)]
    DataParallelUpdate(ctx, trainer, SimpleNamespace(last_gather=summaries))  # type: ignore[arg-type]
    return trainer


def local_update(trainer: GRPOTrainer, ctx: DistContext, b: int) -> None:
    trainer.update(batches()[b][slice(*shard_bounds(6, ctx.rank, WORLD))])  # steps the LR schedule too




def consolidated(trainer: GRPOTrainer, ctx: DistContext) -> dict[str, Any]:
    """The whole optimizer state, as rank 0 would write it, on every rank."""
    consolidate(trainer.optimizer)
    return ctx.broadcast_object(trainer.optimizer.state_dict() if ctx.is_main else None, src=0)


def _ranks(rank: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    ctx = DistContext.init(rank, WORLD, init_method, "cpu")
    out: dict[str, Any] = {}
    # 1. two updates, replicated vs sharded AdamW state
    for stage in (0, 1):
        trainer = dp_trainer(ctx, stage)
        for b in range(2):
            local_update(trainer, ctx, b)
            out[f"params/{stage}/{b}"] = params_of(trainer.model)
        out[f"state_bytes/{stage}"] = optimizer_state_bytes(trainer.optimizer)
        out[f"optimizer/{stage}"] = consolidated(trainer, ctx)
        out[f"sharded/{stage}"] = isinstance(trainer.optimizer, ShardedAdamW)
    # 2. resume: one update, its consolidated state loaded into a fresh sharded trainer, the second update
    first = dp_trainer(ctx, 1)
    local_update(first, ctx, 0)
    saved = consolidated(first, ctx), first.scheduler.state_dict(), params_of(first.model)
    resumed = dp_trainer(ctx, 1)
    resumed.optimizer.load_state_dict(saved[0])
    resumed.scheduler.load_state_dict(saved[1])
    resumed.model.load_state_dict(saved[2])
    out["loaded_bytes"] = optimizer_state_bytes(resumed.optimizer)
    out["exposed_state_after_load"] = len(resumed.optimizer.state)
    local_update(resumed, ctx, 1)
    out["params/resumed"] = params_of(resumed.model)
    # 3. a whole RL step through apply_data_parallel: the per-rank optimizer state metric
    trainer, _ = build_trainer(toy_spec(1), Quiet())  # type: ignore[arg-type]
    dpl = apply_data_parallel(trainer, ctx)
    _, _, per_rank = dist_step(trainer, dpl)
    out["per_rank"] = per_rank
    out["merged"] = merge_step_metrics(per_rank, dpl.rollout.last_gather, trainer.spec.algorithm)[0]
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    ctx.close()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_ranks(_ranks, tmp_path_factory.mktemp("zero"), WORLD)


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def test_sharded_update_equals_replicated_update(rank_results: list[dict]) -> None:
    r0, r1 = rank_results
    assert r0["sharded/1"] and not r0["sharded/0"]
    before = params_of(build_trainer(toy_spec(0), Quiet())[0].model)  # type: ignore[arg-type]
    for b in range(2):
        assert any(not torch.equal(before[k], r0[f"params/0/{b}"][k]) for k in before)
        assert_close(r0[f"params/1/{b}"], r0[f"params/0/{b}"])  # same weights as plain DP, step 1 and 2
        assert_close(r1[f"params/1/{b}"], r0[f"params/1/{b}"], atol=0.0)  # and every rank holds them


def test_each_rank_holds_half_the_optimizer_state(rank_results: list[dict]) -> None:
    full = [r["state_bytes/0"] for r in rank_results]
    shard = [r["state_bytes/1"] for r in rank_results]
    n_params = sum(p.numel() for p in build_trainer(toy_spec(0), Quiet())[0].master.train_params)  # type: ignore
    assert full == [2 * 4 * n_params] * WORLD  # exp_avg + exp_avg_sq in fp32, whole on each rank
    assert sum(shard) == full[0]  # partitioned: every moment on exactly one rank ...
    assert all(0.4 < s / full[0] < 0.6 for s in shard)  # ... about half each
    m = rank_results[0]["merged"]
    per_rank = [p["perf/optimizer_state_mib"] for p in rank_results[0]["per_rank"]]
    assert per_rank == pytest.approx([s / 2**20 for s in shard])
    assert m["perf/optimizer_state_mib"] == pytest.approx(max(per_rank))
    assert [m[f"perf/gpu{r}/optimizer_state_mib"] for r in range(WORLD)] == pytest.approx(per_rank)


def test_consolidated_state_is_the_replicated_optimizers(rank_results: list[dict]) -> None:
    sharded, plain = rank_results[0]["optimizer/1"], rank_results[0]["optimizer/0"]
    assert sharded["state"].keys() == plain["state"].keys() and len(plain["state"]) > 0
    for i, st in plain["state"].items():
        assert float(sharded["state"][i]["step"]) == float(st["step"]) == 2.0
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sharded["state"][i][name], st[name], rtol=0, atol=1e-6)


def test_loading_restores_each_shard_and_the_next_update(rank_results: list[dict]) -> None:
    for r in rank_results:
        assert r["loaded_bytes"] == r["state_bytes/1"]  # its own shard only
        assert r["exposed_state_after_load"] == 0  # no second copy kept
        assert_close(r["params/resumed"], r["params/1/1"], atol=0.0)  # resumed update == uninterrupted one


def test_launched_job_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    launch.run(toy_spec(1), whole, Quiet(), world=WORLD)  # type: ignore[arg-type]
    launch.run(toy_spec(1, max_steps=1), split, Quiet(), world=WORLD)  # type: ignore[arg-type]
    resumed = Quiet()
    launch.run(toy_spec(1), split, resumed, world=WORLD)  # type: ignore[arg-type]
    assert any("resumed from checkpoint step-1" in args[0] for name, args in resumed.calls if name == "log")  # not a run from scratch
    a, b = whole / "checkpoints" / "step-2", split / "checkpoints" / "step-2"
    assert_close(load_file(str(b / "model.safetensors")), load_file(str(a / "model.safetensors")), atol=0.0)
    oa, ob = (torch.load(p / "optimizer.pt", weights_only=False) for p in (a, b))
    assert oa["state"].keys() == ob["state"].keys() and len(oa["state"]) > 0
    for i, st in oa["state"].items():
        for name, t in st.items():
            assert torch.equal(ob["state"][i][name], t), (i, name)
