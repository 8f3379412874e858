"""The policy update on DeepSpeed (rl/deepspeed_update.py) on 2 CPU processes over gloo, tiny fp32 Llama, toy-count:
- two ZeRO-2 and two ZeRO-3 data-parallel updates (global clip on) give the weights of the single-process torch AdamW
  update over the concatenated batch;
- each rank holds half the Adam moments; at ZeRO-3 the trained module's weights are partitioned across the ranks
  and the rollout engine's whole weights are the gathered trained ones after the sync;
- a launched job (env rendezvous, as torchrun) checkpoints through DeepSpeed and resumes exactly: the metrics and
  weights after the resume equal an uninterrupted run's.
DeepSpeed JIT-builds its shared-memory comm op on first use (cached in ~/.cache/torch_extensions, ~2 min once).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from safetensors.torch import load_file

from tests.multigpu.ranks import Quiet, params_of, spawn_ranks
from tests.specs import toy_spec as shared_toy_spec
from worker.tlt.build import build_trainer
from worker.tlt.config import JobSpec
from worker.tlt.multigpu import launch
from worker.tlt.multigpu.context import DistContext
from worker.tlt.multigpu.data_parallel import build_rank
from worker.tlt.multigpu.harvest import HarvestRecord
from worker.tlt.multigpu.rollout_shard import ShardSummary, shard_bounds
from worker.tlt.rl.batch import UpdateSeq
from worker.tlt.rl.optim import optimizer_state_bytes

pytestmark = pytest.mark.slow
WORLD = 2


def toy_spec(resources: dict[str, Any], **over: Any) -> JobSpec:
    """tests/specs.py's toy job with `resources`, no drafter, no validation, several micro-batches per rank."""
    return shared_toy_spec(**{
        "name": "toy-deepspeed",
        "dataset": {"validation_size": 0},
        "algorithm": {"max_grad_norm": 0.05, "micro_batch_tokens": 64},  # several micro-batches: DeepSpeed accumulates
        "drafter": {"kind": "none"},
        "resources": resources,
        "max_steps": 2, "save_steps": 1, "save_total_limit": 2,
        **over,
    })


def ds_spec(stage: int, **over: Any) -> JobSpec:
    return toy_spec({"update_engine": "deepspeed", "zero_stage": stage}, **over)


def batches() -> list[list[UpdateSeq]]:
    """Two fixed batches of 6 ragged sequences (the same in every process)."""
    g = torch.Generator().manual_seed(3)
    return [[UpdateSeq(torch.randint(3, 200, (4 + i % 3,), generator=g).tolist(),
                       torch.randint(3, 200, (1 + 2 * i,), generator=g).tolist(), float((i + b) % 3) - 1.0, None)
             for i in range(6)] for b in range(2)]


def _ranks(rank: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    url = urlparse(init_method)  # the env rendezvous DeepSpeed and torchrun use
    os.environ.update(MASTER_ADDR=str(url.hostname), MASTER_PORT=str(url.port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    ctx = DistContext.init(rank, WORLD, "env://", "cpu")
    lengths = [len(s.response_ids) for s in batches()[0]]
    summaries = [ShardSummary(r, lengths[slice(*shard_bounds(6, r, WORLD))], [False] * 3,
                              HarvestRecord(r, 0.0, 0.0, 0.0, 0, {})) for r in range(WORLD)]
    out: dict[str, Any] = {}
    for stage in (2, 3):
        trainer, dp, _ = build_rank(ds_spec(stage), Quiet(), ctx)  # type: ignore[arg-type]
        assert trainer.ds is not None and trainer.algorithm.name == "dapo"
        dp.shards.last_gather = summaries  # the step's rollout summaries: the loss share's input
        for b in range(2):
            trainer.update(batches()[b][slice(*shard_bounds(6, rank, WORLD))])
            trainer.sync_weights()
            out[f"params/{stage}/{b}"] = params_of(trainer.model)
        out[f"state_bytes/{stage}"] = optimizer_state_bytes(trainer.optimizer)
        out[f"engine_runs_model/{stage}"] = dp.rollout.inner.engine.model is trainer.model  # type: ignore[attr-defined]
        out[f"trained_is_engine/{stage}"] = trainer.ds.train_model is trainer.model
        if stage == 3:  # each rank keeps its partition of every weight
            out["partition_numel"] = sum(p.ds_tensor.numel() for p in trainer.ds.train_model.parameters())  # type: ignore[attr-defined]
        trainer.close()
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    ctx.close(wait_for_peers=True)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_ranks(_ranks, tmp_path_factory.mktemp("deepspeed"), WORLD)


@pytest.fixture(scope="module")
def reference() -> list[dict[str, torch.Tensor]]:
    """The single-process torch AdamW update over each whole batch, weights after each."""
    trainer, _ = build_trainer(toy_spec({"update_engine": "torch"}), Quiet())  # type: ignore[arg-type]
    out = []
    for b in batches():
        trainer.update(b)
        out.append(params_of(trainer.model))
    trainer.close()
    return out


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


@pytest.mark.parametrize("stage", [2, 3])
def test_update_equals_single_process_reference(rank_results: list[dict], reference: list[dict], stage: int) -> None:
    before = params_of(build_trainer(toy_spec({"update_engine": "torch"}), Quiet())[0].model)  # type: ignore
    r0, r1 = rank_results
    for b in range(2):
        assert any(not torch.equal(before[k], reference[b][k]) for k in before)  # the update moved the weights
        assert_close(r0[f"params/{stage}/{b}"], reference[b], atol=5e-5)  # lr 2e-2: moves of ~1e-2 per step
        assert_close(r1[f"params/{stage}/{b}"], r0[f"params/{stage}/{b}"], atol=0.0)  # every rank holds them


def test_optimizer_state_partitioned_and_engine_weights_synced(rank_results: list[dict]) -> None:
    n_params = sum(p.numel() for p in build_trainer(toy_spec({}), Quiet())[0].model.parameters())  # type: ignore
    for stage in (2, 3):
        shard = [r[f"state_bytes/{stage}"] for r in rank_results]
        assert abs(sum(shard) - 2 * 4 * n_params) <= 2 * 4 * WORLD * 64  # Adam moments in fp32, once overall
        assert all(0.4 < s / sum(shard) < 0.6 for s in shard)  # (partitions padded to alignment)
        assert all(r[f"engine_runs_model/{stage}"] for r in rank_results)
    assert all(r["trained_is_engine/2"] for r in rank_results)  # stage 2: the engine runs the trained module
    assert not any(r["trained_is_engine/3"] for r in rank_results)  # stage 3: a gathered copy (synced above)
    parts = [r["partition_numel"] for r in rank_results]
    assert all(0.4 < p / n_params < 0.6 for p in parts)


@pytest.mark.parametrize("stage", [2, 3])
def test_launched_job_resumes_exactly_from_deepspeed_checkpoints(tmp_path: Path, stage: int) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    runs = {}
    for name, steps, d in (("whole", 2, whole), ("first", 1, split), ("resumed", 2, split)):
        runs[name] = Quiet()
        launch.run(ds_spec(stage, max_steps=steps), d, runs[name], world=WORLD)  # type: ignore[arg-type]
    assert any("resumed from checkpoint step-1" in a[0] for n, a in runs["resumed"].calls if n == "log")
    a, b = whole / "checkpoints", split / "checkpoints"
    assert (b / "deepspeed" / "step-2").is_dir() and not (b / "step-2" / "optimizer.pt").exists()
    assert_close(load_file(str(b / "step-2" / "model.safetensors")), load_file(str(a / "step-2" / "model.safetensors")),
                 atol=0.0)
    (mw,) = [args[1] for n, args in runs["whole"].calls if n == "metrics" and args[0] == 2]
    (mr,) = [args[1] for n, args in runs["resumed"].calls if n == "metrics" and args[0] == 2]
    for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"):
        assert mr[k] == mw[k], k
    state = json.loads((b / "step-2" / "trainer_state.json").read_text())
    assert state["step"] == 2


def test_torchrun_job_runs_from_the_environment(tmp_path: Path) -> None:
    """`torchrun -m worker.tlt.multigpu.launch spec.yaml --run-dir DIR`: the ranks meet through torchrun's environment
    (the same command with a host list is a multi-node job); rank 0 writes the run directory."""
    import subprocess
    import sys

    import yaml

    spec_path, run_dir = tmp_path / "spec.yaml", tmp_path / "run"
    spec_path.write_text(yaml.safe_dump(ds_spec(2).model_dump(mode="json")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           "-m", "worker.tlt.multigpu.launch", str(spec_path), "--run-dir", str(run_dir)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # rank 0 alone reports
    assert (run_dir / "checkpoints" / "deepspeed" / "step-2").is_dir()
    assert (run_dir / "policy" / "config.json").exists()
    assert "2 ranks" in (run_dir / "train.log").read_text()


def test_launch_main_outside_a_launcher_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--preset", "demo-cpu", "--run-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and not (tmp_path / "metrics.jsonl").exists()
