"""GRPO / DAPO / Dr.GRPO math: group-normalised advantages, the clipped token loss with its aggregations, the k3 KL
estimator, and token log-probs of given tokens under a model's logits. Pure tensor functions; the step loop is in
trainer.py.

    adv = group_advantages(rewards, group_size=8, scale_rewards=True)        # [N]
    loss, stats = policy_loss(logp, old_logp, adv, mask, spec.algorithm, norm)  # one micro-batch's share

The loss reads its settings (loss_type, epsilon, epsilon_high, beta, max_completion_length) from the job's
AlgorithmConfig itself: one source for them, no copy.

How this departs from the GRPO paper (Shao et al. 2024, DeepSeekMath eq. 3) -- all as TRL's GRPOTrainer does it:
- Aggregation (`loss_type`): the paper averages each response's token losses, then the responses ("grpo" here).
  "dapo" (DAPO, Yu et al. 2025) sums all token losses of the batch and divides by the batch's token count, so long
  responses weigh by their length. "dr_grpo" (Liu et al. 2025) sums all token losses and divides by
  (responses x max_completion_length), a constant, removing the length bias of both others. The normaliser is of
  the *whole* step's batch (`LossNorm`), so micro-batch losses add up exactly to the full-batch loss.
- Advantages: A_i = r_i - mean(group), divided by (std(group) + 1e-4) when `scale_rewards` (the paper); Dr.GRPO
  sets scale_rewards False. std is the unbiased sample std (torch default, as TRL). Every token of a response gets
  its response's advantage (outcome supervision).
- Clipping: ratio clipped to [1 - epsilon, 1 + epsilon_high] (DAPO clip-higher; epsilon_high = epsilon gives the
  paper's symmetric clip). One update per rollout, so with recomputed old log-probs the ratio is 1 in value and the
  clip only matters once old log-probs come from the rollout engine (then it bounds the train/rollout mismatch).
- KL: optional, beta * k3 estimator exp(ref - logp) - (ref - logp) - 1 added per token inside the aggregation
  (the paper's form); beta = 0 (default, as DAPO and Dr.GRPO) keeps no reference model.
- Temperature: log-probs are of logits / temperature, the distribution the rollout sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.tlt.config import AlgorithmConfig


def group_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: bool) -> torch.Tensor:
    """rewards [N] (N = prompts x group_size, groups contiguous) -> advantages [N]."""
    r = rewards.view(-1, group_size).float()  # [P, G]
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_rewards:
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards [N] -> [P] bool: groups whose rewards are all equal (no learning signal; DAPO drops them)."""
    r = rewards.view(-1, group_size)  # [P, G]
    return (r.max(dim=1).values - r.min(dim=1).values) == 0


def clip_range(algo: AlgorithmConfig) -> tuple[float, float]:
    """(low, high) bounds of the ratio: [1 - epsilon, 1 + epsilon_high], epsilon_high None = the symmetric clip."""
    high = algo.epsilon_high if algo.epsilon_high is not None else algo.epsilon
    return 1 - algo.epsilon, 1 + high


@dataclass(frozen=True)
class LossNorm:
    """Sizes of the whole step's batch (all micro-batches), which the aggregations divide by."""

    num_sequences: int  # responses in the update batch
    num_tokens: int  # response tokens (mask ones) in the update batch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V] predicting targets [B, T] -> log p(target) [B, T] under softmax(logits / temperature)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V] -> entropy [B, T] of softmax(logits / temperature)."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


VOCAB_CHUNK_ELEMENTS = 1 << 26  # fp32 elements per chunk of [rows, V] work (256 MB): bounded temporaries


class _ChunkedTokenLogprob(torch.autograd.Function):
    """log p(target) and entropy of softmax(logits / T) row by row in chunks, without keeping any fp32 [n, V]:
    forward saves only the logits (their own dtype) and each row's log-sum-exp; backward recomputes the softmax per
    chunk and writes d logp / d logits = (onehot(target) - softmax) / T straight into the logits' dtype."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,  # [n, V]
        targets: torch.Tensor,  # [n]
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, v = logits.shape
        rows = max(1, VOCAB_CHUNK_ELEMENTS // v)
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty_like(lp)
        lse = torch.empty_like(lp)
        for s in range(0, n, rows):
            z = logits[s : s + rows].float() / temperature  # [c, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [c]
            logp = z.sub_(lse_c[:, None])  # in place: z is not needed again
            lp[s : s + rows] = logp.gather(-1, targets[s : s + rows, None]).squeeze(-1)
            ent[s : s + rows] = -(logp.exp() * logp).sum(-1)
            lse[s : s + rows] = lse_c
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_lp: torch.Tensor, grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None]:
        if grad_lp is None:
            return None, None, None
        logits, targets, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        t = ctx.temperature  # type: ignore[attr-defined]
        n, v = logits.shape
        rows = max(1, VOCAB_CHUNK_ELEMENTS // v)
        grad = torch.empty_like(logits)
        for s in range(0, n, rows):
            g = grad_lp[s : s + rows, None].float() / t  # [c, 1]
            dz = torch.exp(logits[s : s + rows].float() / t - lse[s : s + rows, None]).mul_(-g)  # -softmax * g
            dz.scatter_add_(-1, targets[s : s + rows, None], g)  # + onehot * g
            grad[s : s + rows] = dz
        return grad, None, None


def token_logprobs_entropy(
    logits: torch.Tensor,  # [n, V]
    targets: torch.Tensor,  # [n]
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target) [n] fp32 with grad to logits, entropy [n] fp32 without grad) under softmax(logits /
    temperature); equal to token_logprobs and token_entropy in fp32 but chunked over rows (see the class above)."""
    lp, ent = _ChunkedTokenLogprob.apply(logits, targets, temperature)
    return lp, ent


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate (Schulman's k3): exp(ref - logp) - (ref - logp) - 1, >= 0. [B, T] -> [B, T]."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def policy_loss(
    logp: torch.Tensor,  # [B, T] log-probs of the response tokens under the policy being trained (with grad)
    old_logp: torch.Tensor,  # [B, T] log-probs under the policy that sampled them (no grad)
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,  # [B, T] 1 for response tokens, 0 for padding
    cfg: AlgorithmConfig,  # loss_type, epsilon, epsilon_high, beta, max_completion_length
    norm: LossNorm,
    ref_logp: torch.Tensor | None = None,  # [B, T] reference log-probs when cfg.beta > 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step loss (summing all micro-batches gives the full-batch loss), and sums
    for the metrics: clipped-token counts, KL sum (all detached)."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)  # [B, T]
    low_bound, high_bound = clip_range(cfg)
    clipped = torch.clamp(ratio, low_bound, high_bound)
    a = advantages.unsqueeze(1).to(logp.dtype)  # [B, 1]
    per_token = -torch.min(ratio * a, clipped * a)  # [B, T]
    kl = None
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + cfg.beta * kl
    masked = per_token * mask
    if cfg.loss_type == "grpo":
        loss = (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / norm.num_sequences
    elif cfg.loss_type == "dapo":
        loss = masked.sum() / max(norm.num_tokens, 1)
    elif cfg.loss_type == "dr_grpo":
        loss = masked.sum() / (norm.num_sequences * cfg.max_completion_length)
    else:
        raise ValueError(f"unknown loss_type {cfg.loss_type!r}")
    with torch.no_grad():
        low = (ratio < low_bound) & (a < 0)  # tokens where the lower clip took effect
        high = (ratio > high_bound) & (a > 0)  # ... the upper clip
        stats = {
            "clip_low_tokens": (low.to(mask.dtype) * mask).sum(),
            "clip_high_tokens": (high.to(mask.dtype) * mask).sum(),
            "kl_sum": (kl.detach() * mask).sum() if kl is not None else mask.new_zeros(()),
        }
    return loss, stats
