"""The single-process parts of multi-GPU jobs: prompt shards, loss shares, gradient buckets, metric merging."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.tlt.config import AlgorithmConfig
from worker.tlt.multigpu.harvest import HarvestRecord
from worker.tlt.multigpu.metrics import combine_mean_std, merge_step_metrics
from worker.tlt.multigpu.rollout_shard import ShardSummary, shard_bounds
from worker.tlt.multigpu.update import buckets, loss_share
from worker.tlt.rl.algorithms.registry import resolve


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 64])
def test_shards_cover_every_prompt_exactly_once(n: int, world: int) -> None:
    seen = [i for r in range(world) for i in range(*shard_bounds(n, r, world))]
    assert seen == list(range(n))
    sizes = [shard_bounds(n, r, world)[1] - shard_bounds(n, r, world)[0] for r in range(world)]
    assert max(sizes) - min(sizes) <= 1


def _summary(rank: int, lengths: list[int], idle: float = 0.0, used: float = 0.0) -> ShardSummary:
    return ShardSummary(rank, lengths, [x >= 6 for x in lengths], HarvestRecord(rank, 1.0, idle, used, 0, {}))


def test_loss_share_sums_to_one_by_tokens_or_sequences() -> None:
    s = [_summary(0, [1, 2, 3]), _summary(1, [6])]

    def share(name: str, rank: int) -> float:
        return loss_share(resolve(name), AlgorithmConfig(), s, rank)

    assert share("dapo", 0) == pytest.approx(6 / 12) and share("dapo", 1) == pytest.approx(6 / 12)
    assert share("grpo", 0) == pytest.approx(3 / 4) and share("dr_grpo", 1) == pytest.approx(1 / 4)


def test_buckets_keep_order_and_bound_size() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 4, 10, 1, 2)]
    bs = buckets(params, numel=7)
    assert [p for b in bs for p in b] == params
    assert [[p.numel() for p in b] for b in bs] == [[3, 4], [10], [1, 2]]


def test_combine_mean_std_equals_the_concatenation() -> None:
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=k) for k in (1, 4, 7)]
    mean, std = combine_mean_std([len(p) for p in parts], [float(p.mean()) for p in parts],
                                 [float(p.std(ddof=1)) if len(p) > 1 else 0.0 for p in parts])
    allv = np.concatenate(parts)
    assert mean == pytest.approx(allv.mean()) and std == pytest.approx(allv.std(ddof=1))


def test_merge_step_metrics_rules() -> None:
    per_rank = [
        {"reward/mean": 1.0, "reward/std": 0.0, "actor/pg_loss": 0.25, "actor/entropy": 2.0, "timing_s/gen": 3.0,
         "timing_s/update": 0.5, "harvest/idle_gpu_s": 4.0, "sd/on_fraction": 0.0, "actor/num_groups_used": 1.0},
        {"reward/mean": 0.0, "reward/std": 0.0, "actor/pg_loss": 0.5, "actor/entropy": 4.0, "timing_s/gen": 3.5,
         "timing_s/update": 0.7, "harvest/idle_gpu_s": 4.0, "sd/on_fraction": 1.0, "actor/num_groups_used": 2.0},
    ]
    summaries = [_summary(0, [2, 2], idle=4.0, used=1.5), _summary(1, [6, 6, 6, 6])]
    m, (edges, counts) = merge_step_metrics(per_rank, summaries, AlgorithmConfig(max_completion_length=6))
    assert m["actor/pg_loss"] == 0.75 and m["actor/num_groups_used"] == 3.0  # summed
    assert m["actor/entropy"] == pytest.approx((2 * 4 + 4 * 24) / 28)  # token-weighted
    assert m["sd/on_fraction"] == pytest.approx(4 / 6)  # response-weighted
    assert m["timing_s/gen"] == 3.5 and m["harvest/idle_gpu_s"] == 4.0  # slowest rank; already global
    assert m["reward/mean"] == pytest.approx(2 / 6) and m["reward/std"] == pytest.approx(np.std([1, 1, 0, 0, 0, 0], ddof=1))
    assert m["response_length/max"] == 6 and m["response_length/clip_ratio"] == pytest.approx(4 / 6)
    assert sum(counts) == 6 and m["perf/tokens_per_s"] == pytest.approx(28 / 3.5)
    assert m["timeline/gpu0/drafter_s"] == 1.5 and m["timeline/gpu0/idle_s"] == 2.5
    assert m["timeline/gpu1/update_s"] == 0.7 and m["dist/world_size"] == 2

