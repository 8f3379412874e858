"""A 2-rank job (gloo) with adaptive SD, stopped mid-run or killed mid-run, keeps what its bandit learned: the
checkpoint holds the bandit's state, every rank that resumes from it plays with that state, not a fresh one, and the
resumed job goes on learning from it. The job runs REINFORCE++, whose batch-whitened advantages sum their statistics
over the ranks.

Run: python -m pytest tests/multigpu/test_multigpu_resume_bandit.py -q
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multigpu.ranks import Quiet, spawn_ranks
from tests.multigpu.test_multigpu_gloo import WORLD, StopAfterFirstStep, toy_spec
from worker.tlt.config import JobSpec
from worker.tlt.multigpu import launch
from worker.tlt.multigpu.context import DistContext
from worker.tlt.multigpu.data_parallel import build_rank
from worker.tlt.rl.checkpoint import latest_checkpoint
from worker.tlt.run_dir import resume_from

pytestmark = pytest.mark.slow


def adaptive_spec() -> JobSpec:
    # 4 sequences per rank, below sd_on_below: SD is on from the first step, so the bandit plays (the threshold
    # switch: on CPU the default cost switch rightly keeps SD off)
    return toy_spec(max_steps=4, save_steps=4, algorithm={"name": "reinforce_plus_plus"}, drafter={"kind": "ngram"},
                    rollout={"speculative": "adaptive", "sd_on_below": 16, "sd_patience": 1,
                             "sd_switch": "active_batch"})


def bandit_of(trainer: Any) -> dict:
    ctl = trainer.rollout.sd_controller
    assert ctl is not None
    return ctl.state_dict()["bandit"]


def _resume_ranks(rank: int, init_method: str, out_dir: str) -> None:
    """A fresh rank of the same job: its bandit before and after resuming from the run's checkpoints."""
    torch.set_num_threads(1)
    ctx = DistContext.init(rank, WORLD, init_method, "cpu")
    trainer, dp, _ = build_rank(adaptive_spec(), Quiet(), ctx)  # type: ignore[arg-type]
    fresh = bandit_of(trainer)
    step = resume_from(trainer, Path(out_dir) / "run" / "checkpoints")
    dp.resumed(trainer, step)
    torch.save({"fresh": fresh, "resumed": bandit_of(trainer), "step": step}, Path(out_dir) / f"rank{rank}.pt")
    trainer.close()
    ctx.close(wait_for_peers=True)


def test_a_stopped_two_rank_job_resumes_with_its_bandit(tmp_path: Path) -> None:
    rep = StopAfterFirstStep()
    launch.run(adaptive_spec(), tmp_path / "run", rep, world=WORLD)  # type: ignore[arg-type]
    steps = [args[0] for name, args in rep.calls if name == "metrics"]
    assert 1 <= len(steps) < 4
    path = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert path is not None and path.name == f"step-{steps[-1]}"
    extra = torch.load(path / "extra.pt", weights_only=False)
    assert "adaptive" in extra, "the multi-GPU checkpoint lost the bandit"
    saved = extra["adaptive"]["bandit"]
    assert any(st["round"] > 0 for st in saved["buckets"].values())  # the bandit played during the rollouts

    for r, out in enumerate(spawn_ranks(_resume_ranks, tmp_path, WORLD)):
        assert out["step"] == steps[-1]
        assert out["fresh"] != saved, f"rank {r}: a fresh bandit already equals the saved one"
        assert out["resumed"] == saved, f"rank {r}: the resumed bandit is not the saved one"


# a job process that spawns its ranks (as the Celery worker's job child does) and reports into the run directory
JOB = """
import sys
from pathlib import Path
from worker.tlt.config import JobSpec
from worker.tlt.file_reporter import FileReporter
from worker.tlt.multigpu import launch
run_dir = Path(sys.argv[2])
launch.run(JobSpec.model_validate_json(Path(sys.argv[1]).read_text()), run_dir, FileReporter(run_dir), world=2)
"""


def reached_step_2(checkpoints: Path) -> bool:
    """A complete checkpoint of step 2 or later (each is renamed into place only once complete)."""
    return any(int(p.name.split("-")[1]) >= 2 for p in checkpoints.glob("step-*") if p.name.split("-")[1].isdigit())


def test_a_killed_two_rank_job_resumes_with_its_bandit(tmp_path: Path) -> None:
    # steps of the toy job take well under a second and only the last checkpoint is kept: wait for any checkpoint
    # from step 2 on (polling can miss a given one), in a job too long to end first
    spec = adaptive_spec().model_copy(update={"max_steps": 10_000, "save_steps": 1})
    run_dir = tmp_path / "run"
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    root = Path(__file__).resolve().parents[2]
    job = subprocess.Popen([sys.executable, "-c", JOB, str(tmp_path / "spec.json"), str(run_dir)], cwd=root,
                           start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while not reached_step_2(run_dir / "checkpoints"):
            assert job.poll() is None, f"the job ended before step 2: {job.stderr.read().decode()[-2000:]}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no checkpoint of step 2 within 10 minutes"
            time.sleep(0.2)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the job process and both ranks, mid-run, with no chance to clean up
        job.wait()
    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None
    killed_at = int(path.name.split("-")[1])
    assert 2 <= killed_at < spec.max_steps
    saved = torch.load(path / "extra.pt", weights_only=True)["adaptive"]["bandit"]
    assert any(st["round"] > 0 for st in saved["buckets"].values())

    for r, out in enumerate(spawn_ranks(_resume_ranks, tmp_path, WORLD)):  # every rank's bandit, resumed
        assert out["step"] == killed_at
        assert out["fresh"] != saved, f"rank {r}: a fresh bandit already equals the saved one"
        assert out["resumed"] == saved, f"rank {r}: the resumed bandit is not the saved one"

    rep = Quiet()  # the job run again goes on from there, its bandit learning on from the saved state
    launch.run(spec.model_copy(update={"max_steps": killed_at + 1}), run_dir, rep, world=WORLD)  # type: ignore[arg-type]
    assert any(f"resumed from checkpoint step-{killed_at}" in args[0] for name, args in rep.calls if name == "log")
    after = torch.load(run_dir / "checkpoints" / f"step-{killed_at + 1}" / "extra.pt", weights_only=True)
    rounds = {b: st["round"] for b, st in after["adaptive"]["bandit"]["buckets"].items()}
    assert all(rounds[b] >= st["round"] for b, st in saved["buckets"].items())
    assert sum(rounds.values()) > sum(st["round"] for st in saved["buckets"].values())
