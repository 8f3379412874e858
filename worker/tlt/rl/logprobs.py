"""Token log-probs and entropies of given tokens under a model's logits, of softmax(logits / temperature) (the
distribution the rollout sampled from); the chunked form keeps no fp32 [n, V] for backward. Pure tensor functions;
the RL algorithms that use them are in rl/algorithms/, the step loop in trainer.py.

    lp, ent = token_logprobs_entropy(logits, targets, temperature)   # [n], [n]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
