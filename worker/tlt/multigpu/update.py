"""Data-parallel policy update: each rank backpropagates its own shard's loss, the gradients are all-reduced once
per RL step (DDP-style, bucketed), clipped by the global norm, and every rank takes the same AdamW step.

    updater = DataParallelTorchUpdate(model, spec.algorithm, plan, ctx, algorithm, shards)  # the trainer's Updater

Why replication (DDP-style) and not FSDP2 `fully_shard` for a 135M policy: the whole training state is ~2.4 GB per
GPU (bf16 weights 0.27 GB, fp32 master copies 0.54, fp32 grads 0.54, AdamW moments 1.1), under 2% of an H200, so
sharding saves nothing that matters, while it costs an all-gather before every forward and a reduce-scatter after
every backward, and the rollout engine (colocated: it runs the very module being trained, with CUDA graphs) needs
whole, plain tensors, which FSDP2 replaces with DTensor shards. Replication keeps the engine untouched. Past ~7B
parameters the state no longer fits beside the KV cache: then `resources.zero_stage` (1-3) and
`offload_optimizer` run the update on DeepSpeed instead (rl/deepspeed_update.py, multigpu/data_parallel.py), which
shards the optimizer state, gradients and (stage 3) weights.

Exactness: the trainer normalises its loss by its own shard's batch (rl/algorithms/base.py LossNorm); before the
clip the updater rescales each rank's gradient by its share of the global normaliser (`loss_share`: the algorithm's
aggregation decides, e.g. token counts for `dapo`, sequence counts for `grpo`) and SUM-all-reduces it, so the reduced
gradient is the gradient of the single-process loss over the concatenated batch; the clip (the spec's max_grad_norm)
then sees the global norm, never a local one. All ranks hold the same gradient and take the same step, so the policy
needs no weight broadcast (`check_replicas` verifies it at every checkpoint).

Not supported yet: `dynamic_sampling` (a rank whose groups all drop skips its optimizer step and the others would
wait in the all-reduce; needs a loss-norm seam in GRPOTrainer.update, see the multigpu package docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from worker.tlt.config import AlgorithmConfig
from worker.tlt.model.transformer import Transformer
from worker.tlt.multigpu.context import DistContext
from worker.tlt.rl.algorithms.base import Algorithm, LossNorm
from worker.tlt.rl.update_plan import UpdatePlan
from worker.tlt.rl.updater import TorchUpdate

if TYPE_CHECKING:
    from worker.tlt.multigpu.rollout_shard import ShardSummary, StepShards

BUCKET_NUMEL = 1 << 25  # 32M fp32 elements (128 MB) per all-reduce: few launches, bounded extra memory


def loss_share(algorithm: Algorithm, cfg: AlgorithmConfig, summaries: Sequence[ShardSummary], rank: int) -> float:
    """This rank's local loss normaliser over the global one (the factor that makes local grads sum to global), as
    the algorithm aggregates."""
    local = LossNorm.of_lengths(summaries[rank].lengths)
    total = LossNorm.of_lengths([n for s in summaries for n in s.lengths])
    return algorithm.share(cfg, local, total)


def buckets(params: Sequence[torch.nn.Parameter], numel: int = BUCKET_NUMEL) -> list[list[torch.nn.Parameter]]:
    """Consecutive groups of parameters of at most `numel` elements (a larger parameter is a bucket alone)."""
    out: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if out[-1] and size + p.numel() > numel:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return [b for b in out if b]


@torch.no_grad()
def all_reduce_grads(params: Sequence[torch.nn.Parameter], scale: float) -> None:
    """grad := SUM over ranks of (scale * grad), in place; a missing grad counts as zeros (every rank must send the
    same buckets)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in buckets(params):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # type: ignore[union-attr]
        if scale != 1.0:
            flat.mul_(scale)
        dist.all_reduce(flat)
        offset = 0
        for p in bucket:
            n = p.numel()
            p.grad.copy_(flat[offset: offset + n].view_as(p))  # type: ignore[union-attr]
            offset += n


class DataParallelTorchUpdate(TorchUpdate):
    """rl/updater.py's torch AdamW update as one rank of several: before the clip, each rank's gradient is scaled by
    its share of the global normaliser and summed over the ranks; the clip then sees the global norm."""

    def __init__(self, model: Transformer, algo: AlgorithmConfig, plan: UpdatePlan, ctx: DistContext,
                 algorithm: Algorithm, shards: StepShards) -> None:
        if algo.dynamic_sampling:
            raise ValueError("algorithm.dynamic_sampling is not supported with resources.gpus > 1 yet")
        super().__init__(model, algo, plan)
        self.ctx, self.algorithm, self.cfg, self.shards = ctx, algorithm, algo, shards
        self.last_grad_norm = 0.0
        self.last_share = 1.0

    def clip_grads(self) -> torch.Tensor:
        self.last_share = loss_share(self.algorithm, self.cfg, self.shards.last_gather, self.ctx.rank)
        all_reduce_grads(self.master.train_params, self.last_share)
        norm = super().clip_grads()
        self.last_grad_norm = float(norm)
        return norm


@torch.no_grad()
def replica_fingerprint(module: torch.nn.Module) -> list[float]:
    """[sum, sum of squares, weighted sum] of every parameter in float64: equal on all ranks iff (almost surely)
    the replicas are equal."""
    s = sq = ws = 0.0
    for i, p in enumerate(module.parameters()):
        x = p.detach().double()
        s += float(x.sum())
        sq += float((x * x).sum())
        ws += (i + 1) * float(x.mean())
    return [s, sq, ws]


def check_replicas(ctx: DistContext, module: torch.nn.Module) -> None:
    """Raise when the ranks' copies of `module` differ (the data-parallel invariant; checked before a checkpoint)."""
    prints = ctx.all_gather_objects(replica_fingerprint(module))
    if any(p != prints[0] for p in prints[1:]):
        raise RuntimeError(f"policy replicas diverged across ranks: {prints}")
