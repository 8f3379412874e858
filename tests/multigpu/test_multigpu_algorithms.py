"""Every registered algorithm's loss normaliser under data parallelism, on 2 CPU processes over gloo: each rank takes
its shard of a fixed ragged batch (one empty response included), normalises by its own shard, scales its gradient by
`loss_share` (multigpu/update.py, the algorithm's aggregation) and SUM-reduces it with `all_reduce_grads`; the result
equals the gradient of the single-process loss over the whole batch, and so does the sum of the ranks' shared
losses. Batch-wide advantages (REINFORCE++) computed on each rank's shard with its statistics summed over the ranks
equal the single-process advantages of the whole batch.

Run: python -m pytest tests/multigpu/test_multigpu_algorithms.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multigpu.ranks import spawn_ranks
from worker.tlt.config import AlgorithmConfig
from worker.tlt.multigpu.context import DistContext
from worker.tlt.multigpu.harvest import HarvestRecord
from worker.tlt.multigpu.rollout_shard import ShardSummary, shard_bounds
from worker.tlt.multigpu.update import all_reduce_grads, loss_share
from worker.tlt.rl.algorithms.base import AdvantageInput, LossNorm
from worker.tlt.rl.algorithms.registry import BUILTIN_ALGORITHMS, resolve

pytestmark = pytest.mark.slow
WORLD = 2
LENGTHS = [5, 3, 0, 4, 1, 2, 5]  # 7 responses: rank 0 holds 4 of them (one empty), rank 1 holds 3
CFG = AlgorithmConfig(max_completion_length=5, epsilon=0.2, epsilon_high=0.28)


def batch() -> dict[str, torch.Tensor]:
    """A fixed batch: per-token features [B, T, D], old log-probs, advantages, the mask of LENGTHS."""
    g = torch.Generator().manual_seed(7)
    b, t, d = len(LENGTHS), max(LENGTHS), 4
    return {"x": torch.randn(b, t, d, generator=g), "old": -1.0 + 0.1 * torch.randn(b, t, generator=g),
            "adv": torch.randn(b, generator=g),
            "mask": (torch.arange(t)[None] < torch.tensor(LENGTHS)[:, None]).float()}


REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 1.0]
BATCH_WIDE = ["reinforce_plus_plus"]


def whole_batch_advantages(name: str, lengths: list[int], rows: slice = slice(None),
                           ctx: DistContext | None = None) -> torch.Tensor:
    """The algorithm's advantages of `rows` of the batch (REWARDS, `lengths`); across ranks, statistics summed
    through the process group as the data-parallel trainer does."""
    inp = AdvantageInput(torch.tensor(REWARDS[rows]), 1, torch.tensor(lengths[rows]))
    if ctx is not None:
        inp = AdvantageInput(inp.rewards, 1, inp.lengths, ctx.all_reduce_floats)
    return resolve(name).advantages(inp, CFG)


def loss_and_grad(name: str, rows: slice, norm: LossNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """The algorithm's loss of `rows` under a one-vector policy (logp = x @ w - 1) and its gradient in w."""
    data = batch()
    w = torch.full((data["x"].shape[-1],), 0.05, requires_grad=True)
    logp = data["x"][rows] @ w - 1.0  # [b, T]: shared weights, so every row's gradient mixes into w
    loss, _ = resolve(name).loss(logp, data["old"][rows], data["adv"][rows], data["mask"][rows], CFG, norm)
    loss.backward()
    assert w.grad is not None
    return loss.detach(), w.grad


def _ranks(rank: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    ctx = DistContext.init(rank, WORLD, init_method, "cpu")
    bounds = [shard_bounds(len(LENGTHS), r, WORLD) for r in range(WORLD)]
    summaries = [ShardSummary(r, LENGTHS[a:b], [False] * (b - a), HarvestRecord(r, 0.0, 0.0, 0.0, 0, {}))
                 for r, (a, b) in enumerate(bounds)]
    out: dict[str, Any] = {}
    for name in BUILTIN_ALGORITHMS:
        a, b = bounds[rank]
        loss, grad = loss_and_grad(name, slice(a, b), LossNorm.of_lengths(LENGTHS[a:b]))
        share = loss_share(resolve(name), CFG, summaries, rank)
        p = torch.nn.Parameter(torch.zeros_like(grad))
        p.grad = grad.clone()
        all_reduce_grads([p], share)
        shared_loss = loss * share
        torch.distributed.all_reduce(shared_loss)
        out[name] = (p.grad, shared_loss, share)
    for name in BATCH_WIDE:  # a ragged batch, and one with no response tokens at all
        out[f"adv/{name}"] = [whole_batch_advantages(name, lengths, slice(*bounds[rank]), ctx)
                              for lengths in (LENGTHS, [0] * len(LENGTHS))]
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    ctx.close(wait_for_peers=True)


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_ranks(_ranks, tmp_path_factory.mktemp("algos"), WORLD)


@pytest.mark.parametrize("name", sorted(BUILTIN_ALGORITHMS))
def test_two_ranks_give_the_single_process_gradient(rank_results: list[dict[str, Any]], name: str) -> None:
    loss, grad = loss_and_grad(name, slice(None), LossNorm.of_lengths(LENGTHS))
    assert grad.abs().sum() > 0
    for r in range(WORLD):
        reduced, shared_loss, _ = rank_results[r][name]
        torch.testing.assert_close(reduced, grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(shared_loss, loss, rtol=1e-5, atol=1e-7)
    assert sum(rank_results[r][name][2] for r in range(WORLD)) == pytest.approx(1.0)  # shares of one whole


@pytest.mark.parametrize("name", BATCH_WIDE)
def test_two_ranks_give_the_single_process_batch_advantages(rank_results: list[dict[str, Any]], name: str) -> None:
    for case, lengths in enumerate((LENGTHS, [0] * len(LENGTHS))):
        reference = whole_batch_advantages(name, lengths)
        assert reference.abs().sum() > 0
        gathered = torch.cat([rank_results[r][f"adv/{name}"][case] for r in range(WORLD)])
        torch.testing.assert_close(gathered, reference, rtol=1e-6, atol=1e-6)
