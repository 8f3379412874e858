"""GRPO/DAPO/Dr.GRPO math (their Algorithm parts, resolved from the old loss_type values): advantages, the three
aggregations on hand-computed cases, clipping (values and gradients), k3 KL,
micro-batch additivity, LR schedule.

Run: python -m pytest tests/train/test_train_grpo_loss.py -q
"""

import math

import pytest
import torch

from worker.tlt.config import AlgorithmConfig
from worker.tlt.rl.algorithms.base import AdvantageInput, LossNorm, k3_kl, zero_std_groups
from worker.tlt.rl.algorithms.builtin import clip_range, group_advantages
from worker.tlt.rl.algorithms.registry import resolve
from worker.tlt.rl.logprobs import token_logprobs
from worker.tlt.rl.optim import lr_factor


def policy_loss(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: AlgorithmConfig,
                norm: LossNorm, ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of the algorithm the config names (its loss_type here: the older specs' spelling)."""
    return resolve(cfg.algorithm_name).loss(logp, old, adv, mask, cfg, norm, ref_logp)


def test_group_advantages_scaled_and_unscaled() -> None:
    r = torch.tensor([1.0, 0.0, 2.0, 2.0, 3.0, 0.0])
    std = math.sqrt(0.5)  # unbiased std of [1, 0]
    inp = AdvantageInput(r, group_size=2, lengths=torch.ones(6))
    adv = group_advantages(inp, AlgorithmConfig(scale_rewards=True))
    assert torch.allclose(adv, torch.tensor([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0, 0, 1.5 / (2.1213203 + 1e-4),
                                             -1.5 / (2.1213203 + 1e-4)]), atol=1e-5)
    adv = group_advantages(inp, AlgorithmConfig(scale_rewards=False))
    assert torch.equal(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 1.5, -1.5]))
    assert zero_std_groups(r, 2).tolist() == [False, True, False]


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.zeros(2, 2, requires_grad=True)
    adv = torch.tensor([1.0, -3.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # lengths 2 and 1
    return logp, adv, mask


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        # token losses (ratio 1): [[-1, -1], [3, pad]]
        ("grpo", ((-1 - 1) / 2 + 3 / 1) / 2),  # mean per response, then mean over responses = 1.0
        ("dapo", (-1 - 1 + 3) / 3),  # sum over tokens / tokens = 1/3
        ("dr_grpo", (-1 - 1 + 3) / (2 * 4)),  # sum / (responses * max_completion_length=4)
    ],
)
def test_aggregations_hand_computed(loss_type: str, expected: float) -> None:
    logp, adv, mask = _case()
    cfg = AlgorithmConfig(loss_type=loss_type, max_completion_length=4)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, cfg, LossNorm(num_sequences=2, num_tokens=3))
    assert loss.item() == pytest.approx(expected)


def test_clipping_values_gradients_and_counts() -> None:
    # four one-token responses: ratio 1.5 / 1.5 / 0.5 / 0.5 with advantages +1 / -1 / -1 / +1
    old = torch.zeros(4, 1)
    logp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    mask = torch.ones(4, 1)
    cfg = AlgorithmConfig(loss_type="dapo", epsilon=0.2, epsilon_high=0.28)
    loss, stats = policy_loss(logp, old, adv, mask, cfg, LossNorm(4, 4))
    # per token: -min(1.5, 1.28) = -1.28 (clipped high); -min(-1.5, -1.28) = 1.5; -min(-0.5, -0.8) = 0.8 (clipped
    # low); -min(0.5, 0.8) = -0.5
    assert loss.item() == pytest.approx((-1.28 + 1.5 + 0.8 - 0.5) / 4)
    loss.backward()
    g = logp.grad.squeeze(1)
    assert g[0] == 0 and g[2] == 0  # clipped tokens carry no gradient
    assert g[1].item() == pytest.approx(1.5 / 4)  # d/dlogp of ratio*1 = ratio, over 4 tokens
    assert g[3].item() == pytest.approx(-0.5 / 4)
    assert stats["clip_high_tokens"].item() == 1 and stats["clip_low_tokens"].item() == 1


def test_k3_kl_and_beta_term() -> None:
    logp = torch.tensor([[0.0, -1.0]])
    ref = torch.tensor([[0.5, -1.0]])
    kl = k3_kl(logp, ref)
    assert kl[0, 0].item() == pytest.approx(math.exp(0.5) - 0.5 - 1)
    assert kl[0, 1].item() == 0.0
    cfg = AlgorithmConfig(loss_type="dapo", beta=0.1)
    loss, stats = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), cfg, LossNorm(1, 2), ref_logp=ref)
    assert loss.item() == pytest.approx(0.1 * (math.exp(0.5) - 1.5) / 2)
    assert stats["kl_sum"].item() == pytest.approx(math.exp(0.5) - 1.5)
    with pytest.raises(ValueError):
        policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), cfg, LossNorm(1, 2))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_add_up_to_the_full_batch(loss_type: str) -> None:
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(6, 5, generator=g) * 0.1
    old = logp + torch.randn(6, 5, generator=g) * 0.3
    adv = torch.randn(6, generator=g)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]).float()
    cfg = AlgorithmConfig(loss_type=loss_type, max_completion_length=5)
    norm = LossNorm(6, int(mask.sum()))
    full, _ = policy_loss(logp, old, adv, mask, cfg, norm)
    parts = sum(policy_loss(logp[s], old[s], adv[s], mask[s], cfg, norm)[0] for s in (slice(0, 2), slice(2, 6)))
    assert torch.allclose(full, parts, atol=1e-6)


def test_token_logprobs_with_temperature() -> None:
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    t = torch.tensor([[0]])
    want = torch.log_softmax(logits / 0.5, -1)[0, 0, 0]
    assert token_logprobs(logits, t, 0.5)[0, 0].item() == pytest.approx(want.item())


def test_lr_schedules() -> None:
    assert [lr_factor(s, "constant", 2, 10) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert lr_factor(2, "linear", 2, 10) == 1.0 and lr_factor(6, "linear", 2, 10) == pytest.approx(0.5)
    assert lr_factor(10, "linear", 2, 10) == 0.0
    assert lr_factor(6, "cosine", 2, 10) == pytest.approx(0.5) and lr_factor(10, "cosine", 2, 10) == pytest.approx(0)


def test_clip_range_reads_the_algorithm_config() -> None:
    assert clip_range(AlgorithmConfig(epsilon=0.2)) == pytest.approx((0.8, 1.2))  # epsilon_high unset: symmetric
    assert clip_range(AlgorithmConfig(epsilon=0.2, epsilon_high=0.28)) == pytest.approx((0.8, 1.28))
