"""Data-parallel rollout: every rank generates a contiguous shard of the step's prompts, a rank whose shard is done
spot-trains the drafter until every rank is done (harvest.py), then the ranks exchange a summary of their
trajectories.

    shards = StepShards()                                     # what the update and the drafter hook read too
    rollout = ShardedRollout(inner, ctx, harvester, seed, shards)   # inner: any rl/rollout_io.py Rollout
    trajs, sd = rollout(prompts, n, greedy=False)       # this rank's shard only; shards.last_gather = all ranks'

Sharding is by prompt, so each GRPO group lives on one rank and group advantages stay local (no gather before the
update); batch-wide advantages (REINFORCE++) all-reduce a few sums instead (`GRPOTrainer.batch_sums`).
Every rank samples the same prompts (same PromptSampler seed), so shards need no exchange either. Training
rollouts return the local shard (the update is data-parallel, update.py); validation (greedy) rollouts return all
ranks' trajectories in prompt order, so `GRPOTrainer.validate` scores the whole validation set on every rank.
The sampling stream is reseeded per (rank, rollout) from the engine seed, so ranks draw different tokens and a
resumed run draws the same ones again without saving N generator states.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.tlt.data.prompts import RenderedPrompt
from worker.tlt.multigpu.context import DistContext
from worker.tlt.multigpu.harvest import Harvester, HarvestRecord
from worker.tlt.rl.checkpoint import Stateful
from worker.tlt.rl.rollout_io import FinishCallback, Rollout, Trajectory


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous share of n items; shares differ by at most one, earlier ranks larger."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class ShardSummary:
    """What a rank tells the others after a training rollout (metrics of the whole step are computed from these)."""

    rank: int
    lengths: list[int]  # response lengths of this rank's trajectories
    clipped: list[bool]  # finish_reason == "length"
    harvest: HarvestRecord


class StepShards:
    """Every rank's `ShardSummary` of the step's training rollout, written by `ShardedRollout` and read by the parts
    that need the whole step: the data-parallel update's loss share (update.py) and the drafter hook's harvest
    records (harvest.py). Made before them, so each is handed it at construction."""

    def __init__(self) -> None:
        self.last_gather: list[ShardSummary] = []

    def harvest_records(self) -> list[HarvestRecord]:
        return [s.harvest for s in self.last_gather]


class ShardedRollout:
    def __init__(self, inner: Rollout, ctx: DistContext, harvester: Harvester, seed: int,
                 shards: StepShards) -> None:
        self.inner, self.ctx, self.harvester = inner, ctx, harvester
        self.seed = seed  # base of the per-(rank, rollout) sampling seeds
        self.calls = 0  # training rollouts so far (identical on every rank)
        self.shards = shards

    @property
    def last_gather(self) -> list[ShardSummary]:
        """Every rank's summary of the last training rollout."""
        return self.shards.last_gather

    @property
    def generator(self) -> torch.Generator:
        return self.inner.generator

    @property
    def sd_controller(self) -> Stateful | None:
        """This rank's controller. Each rank's bandit learns from its own shard; checkpoints keep rank 0's, and every
        rank resumes from it."""
        return self.inner.sd_controller

    def on_weights_updated(self) -> None:
        self.inner.on_weights_updated()

    def __call__(
        self, prompts: Sequence[RenderedPrompt], n: int, greedy: bool, on_finish: FinishCallback | None = None
    ) -> tuple[list[Trajectory], dict[str, float]]:
        start, end = shard_bounds(len(prompts), self.ctx.rank, self.ctx.world)
        offset = start * n

        def local_finish(i: int, t: Trajectory) -> None:  # the caller indexes the list it gets back
            assert on_finish is not None
            on_finish(i if not greedy else offset + i, t)

        if greedy:  # validation sets need not divide evenly: a rank may get nothing
            trajs, sd = ([], {}) if start == end else \
                self.inner(prompts[start:end], n, True, on_finish=local_finish if on_finish else None)
            gathered = self.ctx.all_gather_objects(trajs)
            return [t for part in gathered for t in part], sd

        self.calls += 1
        # distinct streams per rank; a function of (seed, rank, call) so a resume needs no saved generator states
        self.generator.manual_seed(self.seed * 1_000_003 + self.calls * 7919 + self.ctx.rank)
        t0 = time.perf_counter()
        trajs, sd = self.inner(prompts[start:end], n, False, on_finish=local_finish if on_finish else None)
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        record = self.harvester.wait_for_all(self.calls, rollout_s=time.perf_counter() - t0)
        summary = ShardSummary(self.ctx.rank, [len(t.response) for t in trajs],
                               [t.finish_reason == "length" for t in trajs], record)
        self.shards.last_gather = self.ctx.all_gather_objects(summary)
        return trajs, sd
