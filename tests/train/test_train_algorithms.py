"""The Algorithm parts beyond the three aggregations of test_train_grpo_loss.py: RLOO's leave-one-out and
REINFORCE++'s batch-whitened advantages, GSPO's sequence-level ratio and clipping (values and gradients), each
against numbers worked by hand on a tiny batch; the registry (names, the loss_type spelling, unknown names) and the
data-parallel share of every aggregation; pyproject declares the built-ins under the entry-point group.

Run: python -m pytest tests/train/test_train_algorithms.py -q
"""

import math
import tomllib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from worker.tlt.config import AlgorithmConfig
from worker.tlt.rl.algorithms.base import AdvantageInput, LossNorm
from worker.tlt.rl.algorithms.registry import BUILTIN_ALGORITHMS, registered_names, resolve

ALL = ["dapo", "dr_grpo", "grpo", "gspo", "reinforce_plus_plus", "rloo"]


def _adv(name: str, rewards: list[float], group: int, lengths: list[int]) -> list[float]:
    inp = AdvantageInput(torch.tensor(rewards), group, torch.tensor(lengths))
    return resolve(name).advantages(inp, AlgorithmConfig()).tolist()


def test_rloo_baseline_is_the_mean_of_the_other_responses() -> None:
    # group [1, 0, 2]: 1 - (0 + 2) / 2 = 0, 0 - (1 + 2) / 2 = -1.5, 2 - (1 + 0) / 2 = 1.5; a flat group gives zeros
    adv = _adv("rloo", [1.0, 0.0, 2.0, 3.0, 3.0, 3.0], 3, [1] * 6)
    assert adv == pytest.approx([0.0, -1.5, 1.5, 0.0, 0.0, 0.0])


def test_reinforce_plus_plus_whitens_over_the_batch_tokens() -> None:
    # lengths 3 and 1: token returns [1, 1, 1, 0], mean 0.75, unbiased variance (3 * 0.0625 + 0.5625) / 3 = 0.25
    assert _adv("reinforce_plus_plus", [1.0, 0.0], 2, [3, 1]) == pytest.approx([0.5, -1.5], rel=1e-6)
    # the baseline is the batch's, not the group's: groups [1, 1] and [0, 0] (no signal to GRPO) get +-sqrt(3)/2
    s = math.sqrt(3) / 2
    assert _adv("reinforce_plus_plus", [1.0, 1.0, 0.0, 0.0], 2, [1] * 4) == pytest.approx([s, s, -s, -s], rel=1e-6)
    assert _adv("grpo", [1.0, 1.0, 0.0, 0.0], 2, [1] * 4) == [0.0] * 4


def test_gspo_ratio_and_clip_are_per_sequence() -> None:
    # response 0: token log-ratios 0.2, 0.4 -> s = exp(0.3) = 1.35 inside [0.8, 1.4], A = +1: loss -s;
    # response 1: log-ratio -0.5 -> s = 0.61 < 0.8 with A = -1: clipped, loss -min(-0.61, -0.8) = 0.8, no gradient
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.2, 0.4], [-0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    cfg = AlgorithmConfig(name="gspo", epsilon=0.2, epsilon_high=0.4)
    loss, stats = resolve("gspo").loss(logp, old, torch.tensor([1.0, -1.0]), mask, cfg, LossNorm(2, 3))
    s0 = math.exp(0.3)
    assert loss.item() == pytest.approx((-s0 + 0.8) / 2)  # mean over responses of each response's loss
    loss.backward()
    assert logp.grad is not None
    # d(-s0)/d logp_t = -s0 / 2 (s0 is exp of the 2-token mean), / 2 responses: the same for both tokens, unlike the
    # token-level ratio (whose gradients would be exp(0.2) and exp(0.4))
    assert logp.grad[0].tolist() == pytest.approx([-s0 / 4, -s0 / 4])
    assert logp.grad[1].tolist() == [0.0, 0.0]
    assert stats["clip_low_tokens"].item() == 1 and stats["clip_high_tokens"].item() == 0


def test_rloo_and_reinforce_plus_plus_average_over_the_batch_tokens() -> None:
    logp = torch.zeros(2, 2, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    for name in ("rloo", "reinforce_plus_plus"):
        loss, _ = resolve(name).loss(logp, logp.detach(), torch.tensor([1.0, -3.0]), mask, AlgorithmConfig(),
                                     LossNorm(2, 3))
        assert loss.item() == pytest.approx((-1 - 1 + 3) / 3)  # token losses [[-1, -1], [3, pad]] over 3 tokens


def test_registry_names_and_the_loss_type_spelling() -> None:
    assert set(ALL) <= set(registered_names())
    assert [resolve(n).name for n in ALL] == ALL
    assert AlgorithmConfig().algorithm_name == "dapo"  # the default of the older loss_type field
    assert AlgorithmConfig(loss_type="grpo").algorithm_name == "grpo"
    assert AlgorithmConfig(name="rloo").algorithm_name == "rloo"
    assert AlgorithmConfig(name="grpo", loss_type="grpo").algorithm_name == "grpo"
    with pytest.raises(ValidationError, match="disagree"):
        AlgorithmConfig(name="gspo", loss_type="grpo")
    with pytest.raises(KeyError, match="registered: .*reinforce_plus_plus"):
        resolve("ppo_with_typo")


@pytest.mark.parametrize("name, share", [
    # shard lengths [3, 0, 2] of all [3, 0, 2, 4]: non-empty responses 2 of 3, tokens 5 of 9
    ("grpo", 2 / 3), ("gspo", 2 / 3), ("dr_grpo", 2 / 3), ("dapo", 5 / 9), ("rloo", 5 / 9),
    ("reinforce_plus_plus", 5 / 9),
])
def test_data_parallel_share_follows_the_aggregation(name: str, share: float) -> None:
    local, total = LossNorm.of_lengths([3, 0, 2]), LossNorm.of_lengths([3, 0, 2, 4])
    assert resolve(name).share(AlgorithmConfig(max_completion_length=8), local, total) == pytest.approx(share)


def test_pyproject_entry_points_declare_the_builtins() -> None:
    root = Path(__file__).resolve().parents[2]
    table = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["tlt.algorithms"]
    assert table == BUILTIN_ALGORITHMS
