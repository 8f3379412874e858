"""Idle-GPU harvesting across ranks: a rank whose rollout shard is done trains the drafter until every rank is done,
and the trained drafter reaches every rank at the step's sync point.

    harvester = Harvester(ctx, online_drafter, max_steps=spec.drafter.max_train_steps_per_rl_step)
    record = harvester.wait_for_all(call, rollout_s)      # in ShardedRollout, after this rank's shard
    hook = DistDrafterHook(ctx, online_drafter, shards.harvest_records)  # the trainer's DrafterHook: broadcast +
                                                                          # harvest/* metrics

Single trainer, not an all-reduce among idle ranks: the set of idle ranks changes while the tail runs, and a
collective over a changing set needs a new process group per step or blocks a rank that is still generating.
The first rank to finish claims the step's training (an atomic `store.add` on the rendezvous store), trains until
the last rank reports done (polling the store between drafter steps, no collective; a step is never cut, so the
others wait for its last one and count that wait as idle), and at the sync point
broadcasts the spot trainer's state (weights, AdamW moments, generators, counters) so every rank holds the same drafter and
any rank can claim the next step. With 2 GPUs at most one rank is ever idle, so nothing is left on the table; with
more, the later finishers only wait (counted in idle, not used).
The engine's own tail hook (training inside a rank's memory-bound tail) is not built in multi-GPU jobs: every rank
would train its own copy and the copies would diverge.

Per-step accounting, per rank: rollout_s (own shard), idle_s (own shard done -> all ranks done), used_s (drafter
steps inside idle_s). `harvest/{idle_gpu_s,used_gpu_s}` are GPU-seconds of this step summed over ranks (what the
dashboard's timeline divides by the lane count), `harvest/gpu{r}/...` per rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from worker.tlt import metric_catalog as mc
from worker.tlt.multigpu.context import DistContext
from worker.tlt.speculative.drafter.spot_trainer import host_copy

if TYPE_CHECKING:
    from worker.tlt.speculative.drafter.online import OnlineDrafter


@dataclass(frozen=True)
class HarvestRecord:
    rank: int
    rollout_s: float  # this rank's shard: rollout start -> its last sequence finished
    idle_s: float  # this rank's shard done -> every rank done
    used_s: float  # drafter training inside idle_s
    steps: int  # drafter optimizer steps taken
    drafter_metrics: dict[str, float]  # drafter/loss, drafter/acc of those steps (empty when none)


class Harvester:
    def __init__(self, ctx: DistContext, drafter: OnlineDrafter | None, max_steps: int, poll_s: float = 0.002) -> None:
        self.ctx, self.drafter, self.max_steps, self.poll_s = ctx, drafter, max_steps, poll_s

    def wait_for_all(self, call: int, rollout_s: float) -> HarvestRecord:
        """Mark this rank's shard of rollout `call` done; train the drafter (if this rank claims it) or wait until
        every rank is done. `call` must be the same number on every rank."""
        store, world = self.ctx.store, self.ctx.world
        key = f"tlt/harvest/{call}"
        has_trainer = self.drafter is not None and self.max_steps > 0
        # claimed before this rank counts as done, so once all are done the trainer (if any) is known to exist
        claimed = has_trainer and store.add(f"{key}/claim", 1) == 1
        store.add(f"{key}/done", 1)
        t0 = time.perf_counter()

        def all_done() -> bool:
            return store.add(f"{key}/done", 0) >= world

        def released() -> bool:  # a drafter step is never cut: everyone waits for the trainer's last one
            return all_done() and (not has_trainer or store.add(f"{key}/free", 0) >= 1)

        steps, used, drafter_metrics = 0, 0.0, {}
        if claimed:
            assert self.drafter is not None
            st = self.drafter.trainer
            before = st.used_gpu_s
            with torch.enable_grad():
                steps = st.train(all_done, self.max_steps, idle_s=0.0)
            used = st.used_gpu_s - before
            drafter_metrics = {k: v for k, v in st.metrics(reset=True).items() if k in (mc.DRAFTER_LOSS, mc.DRAFTER_ACC)}
            store.add(f"{key}/free", 1)
        while not released():
            time.sleep(self.poll_s)
        idle = time.perf_counter() - t0
        if self.drafter is not None:
            self.drafter.trainer.add_idle(idle)  # the spot trainer's cumulative counters (checkpointed)
        return HarvestRecord(self.ctx.rank, rollout_s, idle, used, steps, drafter_metrics)


def harvest_metrics(records: Sequence[HarvestRecord]) -> dict[str, float]:
    """harvest/* of one step: GPU-seconds summed over ranks, and per rank."""
    idle = sum(r.idle_s for r in records)
    used = sum(r.used_s for r in records)
    out = {mc.HARVEST_IDLE: idle, mc.HARVEST_USED: used, mc.HARVEST_RATIO: used / idle if idle > 0 else 0.0}
    for r in records:
        out[f"harvest/gpu{r.rank}/idle_gpu_s"] = r.idle_s
        out[f"harvest/gpu{r.rank}/used_gpu_s"] = r.used_s
    return out


class DistDrafterHook:
    """rl/trainer.py's DrafterHook for multi-GPU jobs: no training here (it ran in the harvest phase); broadcasts the
    drafter of the rank that trained and returns drafter/* and harvest/* of the step (identical on every rank).
    `records()` gives every rank's HarvestRecord of the step's rollout (rollout_shard.py gathers them)."""

    def __init__(self, ctx: DistContext, drafter: OnlineDrafter, records: Callable[[], list[HarvestRecord]]) -> None:
        self.ctx, self.drafter, self.records = ctx, drafter, records

    @property
    def train_drafter(self) -> torch.nn.Module:
        """The drafter model being trained (what the final export writes)."""
        return self.drafter.train_drafter

    def after_update(self, step: int, trajectories: Sequence[Any]) -> dict[str, float]:
        records = self.records()
        trained = [r for r in records if r.steps > 0]
        metrics = harvest_metrics(records)
        if trained:  # one trainer per step (see module docstring)
            src = trained[0].rank
            # the spot trainer's state only (weights, AdamW, generators, counters): each rank keeps its own buffer
            # of hidden states, and publishes the new weights to its engine at the next rollout start
            trainer = self.drafter.trainer
            state = self.ctx.broadcast_object(host_copy(trainer.state_dict()) if self.ctx.rank == src else None, src)
            if self.ctx.rank != src:
                trainer.load_state_dict(state)
            metrics.update(trained[0].drafter_metrics)
        metrics[mc.DRAFTER_STEPS] = float(self.drafter.trainer.steps)
        metrics["drafter/harvest_steps"] = float(sum(r.steps for r in records))
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return self.drafter.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state)
