"""Multi-GPU logic on 2 CPU processes over gloo, with the tiny random Llama on the toy-count task:
- the data-parallel update equals the single-process update on the concatenated batch (dapo and grpo, global clip);
- after an RL step both ranks hold identical policies;
- a rank whose shard finished first trains the drafter, and the trained drafter reaches the other rank;
- harvest/* and per-GPU timeline metrics are reported; `launch.run` runs a whole job (checkpoints, exports).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multigpu.ranks import Quiet, params_of, spawn_ranks
from tests.specs import merged
from tests.specs import toy_spec as shared_toy_spec
from worker.tlt.build import build_trainer
from worker.tlt.config import JobSpec
from worker.tlt.multigpu import launch
from worker.tlt.multigpu.context import DistContext
from worker.tlt.multigpu.data_parallel import build_rank, dist_step
from worker.tlt.multigpu.harvest import HarvestRecord
from worker.tlt.multigpu.metrics import merge_step_metrics
from worker.tlt.multigpu.rollout_shard import ShardSummary, shard_bounds
from worker.tlt.rl.batch import UpdateSeq
from worker.tlt.rl.trainer import GRPOTrainer

pytestmark = pytest.mark.slow
WORLD = 2


def toy_spec(**over: Any) -> JobSpec:
    """tests/specs.py's toy job with SD on and the EAGLE-1 drafter, 2 steps; `over` deep-merged."""
    return shared_toy_spec(**merged({
        "name": "toy-dist",
        "rollout": {"speculative": "on", "sd_on_below": 8},
        "drafter": {"kind": "eagle1", "buffer_gb": 0.01, "max_train_steps_per_rl_step": 50, "learning_rate": 1e-2},
        "max_steps": 2,
        "save_total_limit": 1,
    }, over))


def update_spec(loss_type: str) -> JobSpec:
    return toy_spec(algorithm={"loss_type": loss_type, "max_grad_norm": 0.05}, rollout={"speculative": "off"},
                    drafter={"kind": "none"})


def fixed_batch() -> list[UpdateSeq]:
    """A fixed batch of 6 ragged sequences (the same in every process)."""
    g = torch.Generator().manual_seed(3)
    return [UpdateSeq(torch.randint(3, 200, (4 + i % 3,), generator=g).tolist(),
                      torch.randint(3, 200, (1 + 2 * i,), generator=g).tolist(), float(i % 3) - 1.0, None)
            for i in range(6)]


def update_batch(loss_type: str) -> tuple[GRPOTrainer, list[UpdateSeq]]:
    """A fresh trainer (same seed, same weights in every process) and the fixed batch."""
    trainer, _ = build_trainer(update_spec(loss_type), Quiet())
    return trainer, fixed_batch()


def capture_grads(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    """The gradients the optimizer steps with (after any all-reduce and clip), filled at its next step."""
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): k for k, p in trainer.model.named_parameters()}

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p in trainer.master.train_params:
            assert p.grad is not None
            grads[names[id(p)]] = p.grad.detach().clone()

    trainer.optimizer.register_step_pre_hook(hook)
    return grads




def delay(inner: Any, seconds: float) -> Any:
    """`inner` rollout that finishes `seconds` later (a long tail on this rank)."""

    class Delayed:
        generator = inner.generator
        engine = inner.engine

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            time.sleep(seconds)
            return out

        def on_weights_updated(self) -> None:
            inner.on_weights_updated()

    return Delayed()


def _ranks(rank: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    ctx = DistContext.init(rank, WORLD, init_method, "cpu")
    out: dict[str, Any] = {}
    # 1. the DP update on each rank's shard of a fixed batch
    for loss_type in ("dapo", "grpo"):
        seqs = fixed_batch()
        shards = [seqs[slice(*shard_bounds(len(seqs), r, WORLD))] for r in range(WORLD)]
        summaries = [ShardSummary(r, [len(s.response_ids) for s in sh], [False] * len(sh),
                                  HarvestRecord(r, 0.0, 0.0, 0.0, 0, {})) for r, sh in enumerate(shards)]
        trainer, dp, _ = build_rank(update_spec(loss_type), Quiet(), ctx)  # type: ignore[arg-type]
        dp.shards.last_gather = summaries  # the step's rollout summaries, as the sharded rollout gathers them
        grads = capture_grads(trainer)  # at the optimizer step: sees the reduced, clipped gradient
        trainer.update(shards[rank])
        out[f"update/{loss_type}"] = params_of(trainer.model)
        out[f"grads/{loss_type}"] = grads
        assert dp.update is not None
        out[f"grad_norm/{loss_type}"] = dp.update.last_grad_norm
        trainer.close()
    # 2. one RL step with the drafter; rank 1's shard takes 1.5 s longer, so rank 0 is idle and trains the drafter
    trainer, dpl, _ = build_rank(toy_spec(), Quiet(), ctx)  # type: ignore[arg-type]
    assert dpl.drafter is not None
    if rank == 1:
        dpl.rollout.inner = delay(dpl.rollout.inner, 1.5)
    out["drafter_before"] = params_of(dpl.drafter.train_drafter)
    out["policy_before"] = params_of(trainer.model)
    metrics, _, per_rank = dist_step(trainer, dpl)
    out["policy_after"] = params_of(trainer.model)
    out["drafter_after"] = params_of(dpl.drafter.train_drafter)
    dpl.drafter.begin_rollout(2)  # the next rollout start publishes the trained weights to this rank's engine
    out["serving_after"] = params_of(dpl.drafter.proposer.drafter)
    out["adam_steps"] = [int(s["step"]) for s in dpl.drafter.trainer.optimizer.state_dict()["state"].values()]
    out["records"] = dpl.shards.harvest_records()
    out["merged"] = merge_step_metrics(per_rank, dpl.shards.last_gather, trainer.spec.algorithm)[0]
    trainer.close()
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    ctx.close(wait_for_peers=True)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_ranks(_ranks, tmp_path_factory.mktemp("dist"), WORLD)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool = True) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-7, msg=k)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_dp_update_equals_single_process_update(rank_results: Sequence[dict], loss_type: str) -> None:
    trainer, seqs = update_batch(loss_type)
    before = params_of(trainer.model)
    grads = capture_grads(trainer)
    actor = trainer.update(seqs)  # one process, the concatenated batch
    after = params_of(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert_same(rank_results[0][f"update/{loss_type}"], rank_results[1][f"update/{loss_type}"])
    assert_same(rank_results[0][f"grads/{loss_type}"], grads, exact=False)
    # AdamW's first step is ~lr * sign(grad): gradients equal to fp32 rounding move weights equally up to a small
    # fraction of lr where a gradient is near zero (the gradients themselves are compared tightly above)
    lr = trainer.algo.learning_rate
    for k in after:
        torch.testing.assert_close(rank_results[0][f"update/{loss_type}"][k], after[k], rtol=0, atol=1e-2 * lr)
    # the clip (0.05) was active and used the global norm
    assert rank_results[0][f"grad_norm/{loss_type}"] == pytest.approx(actor["actor/grad_norm"], rel=1e-5)
    assert actor["actor/grad_norm"] > 0.05


def test_after_a_step_both_ranks_hold_the_same_policy(rank_results: Sequence[dict]) -> None:
    r0, r1 = rank_results
    assert_same(r0["policy_after"], r1["policy_after"])
    assert any(not torch.equal(r0["policy_before"][k], r0["policy_after"][k]) for k in r0["policy_before"])


def test_idle_rank_trains_the_drafter_and_it_reaches_the_other_rank(rank_results: Sequence[dict]) -> None:
    r0, r1 = rank_results
    rec = r0["records"]
    assert rec[0].steps > 0 and rec[1].steps == 0  # rank 0 waited for rank 1's 1.5 s tail and trained
    assert rec[0].used_s > 0 and rec[0].idle_s >= rec[0].used_s and rec[0].idle_s > 1.0
    assert any(not torch.equal(r0["drafter_before"][k], r0["drafter_after"][k]) for k in r0["drafter_before"])
    assert_same(r0["drafter_after"], r1["drafter_after"])  # broadcast: weights ...
    assert r0["adam_steps"] == r1["adam_steps"] and r0["adam_steps"][0] == rec[0].steps  # ... and AdamW state
    for r in (r0, r1):  # at the next rollout each rank's engine serves the new weights
        assert_same(r["serving_after"], r["drafter_after"])


def test_harvest_and_timeline_metrics(rank_results: Sequence[dict]) -> None:
    m = rank_results[0]["merged"]
    rec = rank_results[0]["records"]
    assert m["harvest/idle_gpu_s"] == pytest.approx(rec[0].idle_s + rec[1].idle_s)
    assert m["harvest/gpu0/used_gpu_s"] > 0 and m["harvest/gpu1/used_gpu_s"] == 0
    assert 0 < m["harvest/ratio"] <= 1 and m["drafter/harvest_steps"] == rec[0].steps and "drafter/loss" in m
    for r in range(WORLD):
        for phase in ("rollout", "drafter", "idle", "reward", "update", "sync"):
            assert m[f"timeline/gpu{r}/{phase}_s"] >= 0
    assert m["timeline/gpu1/rollout_s"] > m["timeline/gpu0/rollout_s"] + 1.0
    assert m["response_length/mean"] > 0 and m["dist/world_size"] == 2


def test_launch_runs_a_job_and_resumes_it(tmp_path: Path) -> None:
    first = Quiet()
    launch.run(toy_spec(max_steps=1, save_steps=1), tmp_path, first, world=WORLD)  # type: ignore[arg-type]
    assert [args[0] for name, args in first.calls if name == "metrics"] == [1]
    assert (tmp_path / "checkpoints" / "step-1" / "model.safetensors").exists()

    rep = Quiet()  # every rank resumes from step-1 (check_replicas would raise on a rank that did not)
    launch.run(toy_spec(max_steps=2, save_steps=1, eval_steps=2), tmp_path, rep, world=WORLD)  # type: ignore[arg-type]
    assert any("resumed from checkpoint step-1" in args[0] for name, args in rep.calls if name == "log")
    metrics = [args for name, args in rep.calls if name == "metrics"]
    assert [step for step, _ in metrics] == [2]
    m = metrics[0][1]
    assert {"harvest/idle_gpu_s", "harvest/used_gpu_s", "timeline/gpu1/rollout_s", "actor/grad_norm"} <= m.keys()
    assert m["drafter/steps"] >= m["drafter/harvest_steps"] and "val/pass@1" in m
    kinds = {args[0] for name, args in rep.calls if name == "artifact"}
    assert kinds == {"checkpoint", "policy", "drafter"}
    assert (tmp_path / "checkpoints" / "step-2").is_dir() and (tmp_path / "policy" / "config.json").exists()


class StopAfterFirstStep(Quiet):
    """A cancel that arrives once the job has reported its first step (seen by the job process, not the ranks)."""

    def should_stop(self) -> bool:
        return any(name == "metrics" for name, _ in self.calls)


def test_a_stop_request_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    rep = StopAfterFirstStep()
    launch.run(toy_spec(max_steps=6, save_steps=6), tmp_path, rep, world=WORLD)  # type: ignore[arg-type]
    steps = [args[0] for name, args in rep.calls if name == "metrics"]
    assert steps == list(range(1, len(steps) + 1)) and 1 <= len(steps) < 6
    logs = [args[0] for name, args in rep.calls if name == "log"]
    assert f"stop requested: stopping after step {steps[-1]}" in logs
    # both ranks stopped after the same step: the checkpoint's replica check passed and rank 0 wrote that step
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [f"step-{steps[-1]}"]
    assert [args[0] for name, args in rep.calls if name == "artifact"] == ["checkpoint"]  # no export after a stop
    assert not (tmp_path / "policy").exists()
