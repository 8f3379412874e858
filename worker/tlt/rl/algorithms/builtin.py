"""The built-in RL algorithms, named as TRL (GRPOConfig.loss_type) and verl (adv_estimator, policy loss mode) name
them: grpo, dapo, dr_grpo, gspo, rloo, reinforce_plus_plus. Each is an advantage estimator, a policy loss and an
aggregation (base.py); registry.py maps the names here.

How they depart from their papers, and from each other:
- Advantages (one scalar per response; every token of a response gets it, outcome supervision):
  `group_advantages` A_i = r_i - mean(group), divided by (std(group) + 1e-4) when `scale_rewards` (GRPO paper, Shao
  et al. 2024; std the unbiased sample std as TRL). Dr.GRPO (Liu et al. 2025) is run with scale_rewards False as TRL
  leaves it a separate switch. `leave_one_out_advantages` (RLOO, Ahmadian et al. 2024): r_i - mean of the other
  G-1 rewards of the group = G/(G-1) (r_i - mean(group)). `batch_whitened_advantages` (REINFORCE++, Hu 2025, as
  verl runs it with outcome rewards, gamma 1 and no KL in the reward): every token's return is its response's
  reward, whitened over all response tokens of the step's batch (token-weighted mean, unbiased variance), so the
  baseline is the batch's, not the group's.
- Policy loss: `clipped_token_loss` (PPO/GRPO): ratio exp(logp - old_logp) per token clipped to
  [1 - epsilon, 1 + epsilon_high] (DAPO clip-higher; epsilon_high None = symmetric). `sequence_ratio_loss` (GSPO,
  Zheng et al. 2025): one ratio per response, exp(mean of its token log-ratios), clipped per response (the paper's
  epsilons are ~3e-4 / 4e-4: set epsilon / epsilon_high). One update per rollout with recomputed old log-probs makes
  every ratio 1 in value, so clipping matters only once old log-probs come from elsewhere.
- Aggregation: grpo and gspo average each response's tokens, then the responses; dapo, rloo and reinforce_plus_plus
  average over all tokens of the batch (verl's default token-mean); dr_grpo divides the token sum by (responses x
  max_completion_length).
"""

from __future__ import annotations

import torch

from worker.tlt.config import AlgorithmConfig
from worker.tlt.rl.algorithms.base import (
    SEQ_MEAN_TOKEN_MEAN,
    SEQ_MEAN_TOKEN_SUM_NORM,
    TOKEN_MEAN,
    AdvantageInput,
    Algorithm,
    TokenLoss,
)

WHITEN_EPS = 1e-8  # added to the variance before the square root (batch whitening)


def group_advantages(inp: AdvantageInput, cfg: AlgorithmConfig) -> torch.Tensor:
    """r - mean(group), over (std(group) + 1e-4) when cfg.scale_rewards. [N] -> [N]."""
    r = inp.rewards.view(-1, inp.group_size).float()  # [P, G]
    adv = r - r.mean(dim=1, keepdim=True)
    if cfg.scale_rewards:
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


def leave_one_out_advantages(inp: AdvantageInput, cfg: AlgorithmConfig) -> torch.Tensor:
    """r_i - mean of the group's other rewards. [N] -> [N]."""
    r = inp.rewards.view(-1, inp.group_size).float()  # [P, G]
    g = inp.group_size
    return (g / (g - 1) * (r - r.mean(dim=1, keepdim=True))).reshape(-1)


def batch_whitened_advantages(inp: AdvantageInput, cfg: AlgorithmConfig) -> torch.Tensor:
    """(r - mean) / sqrt(var + 1e-8) over every response token of the batch (each response weighs by its length;
    var unbiased over the token count). [N] -> [N]. The mean, then the squared deviations from it, are summed over
    the whole batch by `inp.batch_sums` (two passes, as the single-process formula), so a data-parallel rank's
    shard gets the advantages the whole batch would."""
    r = inp.rewards.double()
    w = inp.lengths.double()
    n, weighted, count, total = inp.batch_sums([float(w.sum()), float((w * r).sum()), float(len(r)), float(r.sum())])
    if n <= 1:  # no tokens to weigh by: centre on the mean response reward
        return (r - total / max(count, 1)).float()
    mean = weighted / n
    (squares,) = inp.batch_sums([float((w * (r - mean) ** 2).sum())])
    return ((r - mean) / (squares / (n - 1) + WHITEN_EPS) ** 0.5).float()


def clip_range(cfg: AlgorithmConfig) -> tuple[float, float]:
    """(low, high) bounds of the ratio: [1 - epsilon, 1 + epsilon_high], epsilon_high None = the symmetric clip."""
    high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    return 1 - cfg.epsilon, 1 + high


def _clipped(ratio: torch.Tensor, a: torch.Tensor, cfg: AlgorithmConfig) -> TokenLoss:
    """-min(ratio * a, clip(ratio) * a) and where each bound took effect; ratio and a broadcast alike."""
    low, high = clip_range(cfg)
    loss = -torch.min(ratio * a, torch.clamp(ratio, low, high) * a)
    with torch.no_grad():
        return TokenLoss(loss, (ratio < low) & (a < 0), (ratio > high) & (a > 0))


def clipped_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                       cfg: AlgorithmConfig) -> TokenLoss:
    """The per-token clipped surrogate: ratio exp(logp - old_logp) [B, T], advantages [B]."""
    return _clipped(torch.exp(logp - old_logp), advantages.unsqueeze(1).to(logp.dtype), cfg)


def sequence_ratio_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        cfg: AlgorithmConfig) -> TokenLoss:
    """GSPO: the clipped surrogate of one ratio per response, s = exp(mean over its tokens of logp - old_logp) [B],
    written onto each of its tokens (a per-response token mean then gives the response's loss)."""
    log_ratio = ((logp - old_logp) * mask).sum(1) / mask.sum(1).clamp(min=1)  # [B]
    seq = _clipped(torch.exp(log_ratio), advantages.to(logp.dtype), cfg)  # [B]
    return TokenLoss(*(t.unsqueeze(1).expand_as(logp) for t in (seq.per_token, seq.clipped_low, seq.clipped_high)))


GRPO = Algorithm("grpo", group_advantages, clipped_token_loss, SEQ_MEAN_TOKEN_MEAN)
DAPO = Algorithm("dapo", group_advantages, clipped_token_loss, TOKEN_MEAN)
DR_GRPO = Algorithm("dr_grpo", group_advantages, clipped_token_loss, SEQ_MEAN_TOKEN_SUM_NORM)
GSPO = Algorithm("gspo", group_advantages, sequence_ratio_loss, SEQ_MEAN_TOKEN_MEAN)
RLOO = Algorithm("rloo", leave_one_out_advantages, clipped_token_loss, TOKEN_MEAN)
REINFORCE_PLUS_PLUS = Algorithm("reinforce_plus_plus", batch_whitened_advantages, clipped_token_loss, TOKEN_MEAN)
