"""One step's metrics of a multi-GPU job, merged from every rank's `GRPOTrainer.step()` metrics and the shard
summaries (what rank 0 reports), plus the per-GPU timeline intervals.

    merged, (edges, counts) = merge_step_metrics(per_rank, summaries, algo)

Rules: response lengths, their histogram and tokens/s are recomputed from all ranks' lengths; reward mean/std are
combined exactly from each rank's count, mean and unbiased std; sums for counts and the (pre-scaled) loss; the
slowest rank for timings; token-weighted means for per-token actor/rollout statistics; metrics every rank already
agrees on (harvest/*, drafter/*, actor/grad_norm, actor/lr, val/*) pass through; anything else is a mean weighted by
the rank's number of responses. perf/optimizer_state_mib (ZeRO shards it) and perf/peak_mem_mib (CUDA) are the
largest rank's, and each rank's as perf/gpu{r}/optimizer_state_mib and perf/gpu{r}/peak_mem_mib.

Timeline (`timeline/gpu{r}/{rollout,drafter,idle,reward,update,sync}_s`): the step's phases of GPU r in order,
seconds. rollout = its own shard, drafter = harvested training, idle = waiting for the other ranks untrained,
sync = weight sync plus the drafter broadcast. The dashboard's GPU timeline (frontend/src/charts/timeline.ts) can draw
lane r from these instead of splitting `harvest/*` evenly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from worker.tlt.config import AlgorithmConfig
from worker.tlt.multigpu.rollout_shard import ShardSummary
from worker.tlt.rl.trainer import length_histogram, length_stats

SUMMED = ("actor/pg_loss", "actor/num_groups_used")
PASS_THROUGH_PREFIXES = ("harvest/", "drafter/", "val/")
PASS_THROUGH = ("actor/grad_norm", "actor/lr")
TOKEN_WEIGHTED_PREFIXES = ("actor/", "rollout/")
MAXED = ("rollout/logp_abs_diff_max", "perf/optimizer_state_mib", "perf/peak_mem_mib")  # memory: the fullest rank
PER_GPU = ("perf/optimizer_state_mib", "perf/peak_mem_mib")  # also per rank: perf/gpu{r}/optimizer_state_mib, ...


def combine_mean_std(counts: Sequence[int], means: Sequence[float], stds: Sequence[float]) -> tuple[float, float]:
    """Mean and unbiased std of the union of groups given each group's size, mean and unbiased std."""
    n = sum(counts)
    total = sum(c * m for c, m in zip(counts, means, strict=True))
    sq = sum((c - 1) * s * s + c * m * m for c, m, s in zip(counts, means, stds, strict=True))
    mean = total / n
    var = (sq - n * mean * mean) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(max(var, 0.0))


def timeline(per_rank: Sequence[dict[str, float]], summaries: Sequence[ShardSummary]) -> dict[str, float]:
    out: dict[str, float] = {}
    for m, s in zip(per_rank, summaries, strict=True):
        h, r = s.harvest, s.rank
        out[f"timeline/gpu{r}/rollout_s"] = h.rollout_s
        out[f"timeline/gpu{r}/drafter_s"] = h.used_s
        out[f"timeline/gpu{r}/idle_s"] = max(h.idle_s - h.used_s, 0.0)
        out[f"timeline/gpu{r}/reward_s"] = m.get("timing_s/reward", 0.0)
        out[f"timeline/gpu{r}/update_s"] = m.get("timing_s/update", 0.0)
        out[f"timeline/gpu{r}/sync_s"] = m.get("timing_s/sync", 0.0) + m.get("timing_s/drafter", 0.0)
    return out


def merge_step_metrics(
    per_rank: Sequence[dict[str, float]], summaries: Sequence[ShardSummary], algo: AlgorithmConfig
) -> tuple[dict[str, float], tuple[list[float], list[int]]]:
    """(merged metrics, response-length histogram of all ranks). `per_rank[r]` is rank r's step metrics with
    actor/pg_loss already multiplied by its loss share (update.py `loss_share`)."""
    lengths = np.array([x for s in summaries for x in s.lengths], dtype=np.float64)
    clipped = np.array([x for s in summaries for x in s.clipped], dtype=np.float64)
    counts = [len(s.lengths) for s in summaries]
    tokens = [float(sum(s.lengths)) for s in summaries]
    out: dict[str, float] = {}
    for name in per_rank[0]:
        vals = [m.get(name, 0.0) for m in per_rank]
        if name in SUMMED:
            out[name] = float(sum(vals))
        elif name.startswith("timing_s/"):
            out[name] = float(max(vals))
        elif name in MAXED:
            out[name] = float(max(vals))
        elif name in PASS_THROUGH or name.startswith(PASS_THROUGH_PREFIXES):
            out[name] = vals[0]
        else:
            w = tokens if name.startswith(TOKEN_WEIGHTED_PREFIXES) else counts
            out[name] = float(np.average(vals, weights=w)) if sum(w) > 0 else float(np.mean(vals))
    out.update(length_stats(lengths, clipped))
    mean, std = combine_mean_std(counts, [m["reward/mean"] for m in per_rank], [m["reward/std"] for m in per_rank])
    out["reward/mean"], out["reward/std"] = mean, std
    out["perf/tokens_per_s"] = float(lengths.sum()) / max(out.get("timing_s/gen", 0.0), 1e-9)
    out["dist/world_size"] = float(len(per_rank))
    out.update(timeline(per_rank, summaries))
    for name in PER_GPU:
        for r, m in enumerate(per_rank):
            if name in m:
                out[name.replace("/", f"/gpu{r}/", 1)] = m[name]
    return out, length_histogram(lengths, algo.max_completion_length)
