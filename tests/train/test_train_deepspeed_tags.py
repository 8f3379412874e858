"""DeepSpeed's checkpoint tags (run_dir/checkpoints/deepspeed/step-N, rl/checkpoint.py) live and die with their
step-N: a run's pruning removes the tags of pruned steps, and a resume removes a tag whose step-N never completed."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.tlt.rl.checkpoint import DEEPSPEED_DIR, capture_rng, clean_partial, load_checkpoint, save_checkpoint


def write_step(root: Path, step: int, keep: int) -> Path:
    (root / DEEPSPEED_DIR / f"step-{step}").mkdir(parents=True)  # what every rank's engine.save_checkpoint writes
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return save_checkpoint(root, step, model=model, optimizer=None, scheduler=sched, rng=capture_rng(None),
                           trainer_state={}, keep=keep)


def test_pruning_and_partial_saves_take_their_tags(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        write_step(tmp_path, step, keep=2)
    tags = tmp_path / DEEPSPEED_DIR
    assert sorted(p.name for p in tags.iterdir()) == ["step-2", "step-3"]  # step-1 pruned with its checkpoint
    ck = load_checkpoint(tmp_path / "step-3")
    assert ck.optimizer == {} and not (tmp_path / "step-3" / "optimizer.pt").exists()
    (tags / "step-4").mkdir()  # the ranks wrote their shards, rank 0 stopped before step-4 existed
    clean_partial(tmp_path)
    assert sorted(p.name for p in tags.iterdir()) == ["step-2", "step-3"]
