"""The `Algorithm` part of the RL step: an advantage estimator, a policy loss and the aggregation of its token
losses, which also fixes how data-parallel ranks share the step's loss. The trainer looks the algorithm up by name
(registry.py) and never branches on it; the built-ins are in builtin.py.

    algo = resolve(spec.algorithm.algorithm_name)
    adv = algo.advantages(AdvantageInput(rewards, group_size, lengths, batch_sums), cfg) # [N]
    loss, stats = algo.loss(logp, old_logp, adv, mask, cfg, norm, ref_logp)              # one micro-batch's share
    share = algo.share(cfg, local=LossNorm(...), total=LossNorm(...))                    # data-parallel gradient scale

A new algorithm is an `Algorithm(...)` built from these pieces (or new functions of the same signatures), declared
under the `tlt.algorithms` entry-point group of its package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.tlt.config import AlgorithmConfig


@dataclass(frozen=True)
class LossNorm:
    """Sizes of a batch that aggregations divide by: the whole step's (all micro-batches), so micro-batch losses add
    up exactly to the full-batch loss; a rank's own shard's under data parallelism (see Algorithm.share)."""

    num_sequences: int  # non-empty responses in the update batch
    num_tokens: int  # response tokens (mask ones) in the update batch

    @staticmethod
    def of_lengths(lengths: list[int]) -> LossNorm:
        """The norm of responses of these lengths (empty responses are not trained on, so they count nowhere)."""
        return LossNorm(num_sequences=sum(1 for n in lengths if n > 0), num_tokens=sum(lengths))


BatchSums = Callable[[list[float]], list[float]]  # sums over the whole step's batch of each rank's partial sums


def local_sums(partial: list[float]) -> list[float]:
    """A single process holds the whole batch: its sums are the batch's."""
    return partial


@dataclass(frozen=True)
class AdvantageInput:
    """What an advantage estimator reads: one scalar reward per response, groups of `group_size` contiguous. Groups
    never span data-parallel ranks; an estimator reading the whole batch (not one group) combines its statistics with
    `batch_sums`, which all-reduces them across ranks (multigpu/data_parallel.py) and is the identity otherwise."""

    rewards: torch.Tensor  # [N] float
    group_size: int
    lengths: torch.Tensor  # [N] response lengths in tokens (token-weighted statistics)
    batch_sums: BatchSums = local_sums


@dataclass(frozen=True)
class TokenLoss:
    """A policy loss before aggregation: per-token losses and where each clip bound took effect."""

    per_token: torch.Tensor  # [B, T] (padding positions arbitrary: the aggregation masks them)
    clipped_low: torch.Tensor  # [B, T] bool
    clipped_high: torch.Tensor  # [B, T] bool


AdvantageFn = Callable[[AdvantageInput, AlgorithmConfig], torch.Tensor]  # -> [N]
# (logp [B, T] with grad, old_logp [B, T], advantages [B], mask [B, T] float, cfg) -> TokenLoss
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AlgorithmConfig], TokenLoss]


@dataclass(frozen=True)
class Aggregation:
    """How token losses become the step loss (verl's loss_agg_mode names): the masked token losses, averaged per
    response first or summed, divided by a denominator of the whole batch. The denominator is linear in the batch's
    sizes, so a rank's share of the data-parallel loss is denominator(own shard) / denominator(all shards)."""

    name: str
    sequence_mean_first: bool  # each response's token losses averaged before summing over responses
    denominator: Callable[[LossNorm, AlgorithmConfig], float]

    def reduce(self, masked: torch.Tensor, mask: torch.Tensor, cfg: AlgorithmConfig, norm: LossNorm) -> torch.Tensor:
        """masked [B, T] (token losses x mask), mask [B, T] -> this micro-batch's share of the step loss."""
        if self.sequence_mean_first:
            total = (masked.sum(1) / mask.sum(1).clamp(min=1)).sum()
        else:
            total = masked.sum()
        return total / max(self.denominator(norm, cfg), 1)


# the mean over responses of each response's token mean (GRPO paper; TRL loss_type "grpo")
SEQ_MEAN_TOKEN_MEAN = Aggregation("seq-mean-token-mean", True, lambda n, c: n.num_sequences)
# the mean over all tokens of the batch: long responses weigh by their length (DAPO; TRL "dapo")
TOKEN_MEAN = Aggregation("token-mean", False, lambda n, c: n.num_tokens)
# token sum over (responses x max_completion_length), a constant: no length bias (Dr.GRPO; TRL "dr_grpo")
SEQ_MEAN_TOKEN_SUM_NORM = Aggregation("seq-mean-token-sum-norm", False,
                                      lambda n, c: n.num_sequences * c.max_completion_length)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards [N] -> [P] bool: groups whose rewards are all equal (no learning signal; DAPO's dynamic sampling drops
    them)."""
    r = rewards.view(-1, group_size)  # [P, G]
    return (r.max(dim=1).values - r.min(dim=1).values) == 0


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate (Schulman's k3): exp(ref - logp) - (ref - logp) - 1, >= 0. [B, T] -> [B, T]."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantages: AdvantageFn
    policy_loss: PolicyLossFn
    aggregation: Aggregation

    def loss(
        self,
        logp: torch.Tensor,  # [B, T] log-probs of the response tokens under the policy being trained (with grad)
        old_logp: torch.Tensor,  # [B, T] log-probs under the policy that sampled them (no grad)
        advantages: torch.Tensor,  # [B]
        mask: torch.Tensor,  # [B, T] 1 for response tokens, 0 for padding
        cfg: AlgorithmConfig,
        norm: LossNorm,
        ref_logp: torch.Tensor | None = None,  # [B, T] reference log-probs when cfg.beta > 0
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step loss (summing all micro-batches gives the full-batch loss), and sums
        for the metrics: clipped-token counts, KL sum (all detached). The KL term, beta * k3 per token, is added
        inside the aggregation (the GRPO paper's form)."""
        mask = mask.to(logp.dtype)
        out = self.policy_loss(logp, old_logp, advantages, mask, cfg)
        per_token, kl = out.per_token, None
        if cfg.beta > 0:
            if ref_logp is None:
                raise ValueError("beta > 0 needs ref_logp")
            kl = k3_kl(logp, ref_logp)
            per_token = per_token + cfg.beta * kl
        loss = self.aggregation.reduce(per_token * mask, mask, cfg, norm)
        with torch.no_grad():
            stats = {
                "clip_low_tokens": (out.clipped_low.to(mask.dtype) * mask).sum(),
                "clip_high_tokens": (out.clipped_high.to(mask.dtype) * mask).sum(),
                "kl_sum": (kl.detach() * mask).sum() if kl is not None else mask.new_zeros(()),
            }
        return loss, stats

    def share(self, cfg: AlgorithmConfig, local: LossNorm, total: LossNorm) -> float:
        """A data-parallel rank's share of the step loss: its local loss (normalised by its own shard) times this is
        its part of the loss over all ranks' batch, so the SUM of the ranks' scaled gradients is the single-process
        gradient."""
        whole = self.aggregation.denominator(total, cfg)
        return self.aggregation.denominator(local, cfg) / whole if whole else 0.0
