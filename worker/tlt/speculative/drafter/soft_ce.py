"""Soft cross-entropy through a frozen, shared LM head, computed in row chunks without keeping [N, V] logits.

    ce_i = CE(softmax(t_i W^T), softmax(x_i W^T)) = logsumexp(z_i) - <p_i, z_i>,  z = x W^T, p = softmax(t W^T)

EAGLE-1's distillation term: x is the drafter's predicted feature, t the target's feature of the same position and
W the target's head (frozen). Its gradient is d ce_i / d x_i = (softmax(z_i) - p_i) W, so the forward computes it
chunk by chunk while the chunk's logits are live and keeps only an [N, H] result for backward: peak memory is one
chunk of [rows, V] fp32 tensors instead of four full [N, V] ones, and no logit is recomputed in backward. Matmuls run
in bf16 on CUDA (fp32 on CPU), softmax / logsumexp in fp32. Like gpt-fast's model code, written for one device.

Run the tests: `python -m pytest tests/drafter/test_drafter_spot_step.py -q`.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_ELEMS = 2**26  # logits per chunk (rows x V): 256 MB per fp32 [rows, V] tensor, about three live at once


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if x.is_cuda else torch.float32


class _SoftCE(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,  # [N, H] drafter output (the only input with a gradient)
        t: torch.Tensor,  # [N, H] target feature
        head: torch.Tensor,  # [V, H] frozen head
        chunk: int,  # rows per chunk
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ce [N] fp32, agree [N] bool (argmax z == argmax t)
        n = x.shape[0]
        cdt = _matmul_dtype(x)
        w = head.to(cdt)
        want_grad = bool(ctx.needs_input_grad[0])
        ce = torch.empty(n, dtype=torch.float32, device=x.device)
        agree = torch.empty(n, dtype=torch.bool, device=x.device)
        grad = torch.empty(n, x.shape[1], dtype=torch.float32, device=x.device) if want_grad else None
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            z = (x[a:b].to(cdt) @ w.T).float()  # [c, V] drafter logits
            p = torch.softmax((t[a:b].to(cdt) @ w.T).float(), -1)  # [c, V] target distribution
            agree[a:b] = z.argmax(-1) == p.argmax(-1)
            lse = torch.logsumexp(z, -1)  # [c]
            ce[a:b] = lse - torch.linalg.vecdot(p, z)
            if grad is not None:
                q = z.sub_(lse[:, None]).exp_().sub_(p)  # softmax(z) - p, in z's memory
                grad[a:b] = (q.to(cdt) @ w).float()
        ctx.mark_non_differentiable(agree)
        ctx.save_for_backward(grad)
        return ce, agree

    @staticmethod
    def backward(ctx: Any, g_ce: torch.Tensor, _g_agree: Any) -> tuple[torch.Tensor | None, None, None, None]:
        (grad,) = ctx.saved_tensors
        return (g_ce[:, None] * grad if grad is not None else None), None, None, None


def soft_cross_entropy(
    x: torch.Tensor,  # [N, H] drafter output
    t: torch.Tensor,  # [N, H] target feature (no gradient)
    head: torch.Tensor,  # [V, H] frozen head (no gradient)
    chunk_elems: int = CHUNK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor]:  # per-row soft-CE [N] fp32 (differentiable in x), top-1 agreement [N] bool
    chunk = max(1, chunk_elems // head.shape[0])
    ce, agree = _SoftCE.apply(x, t.detach(), head.detach(), chunk)
    return ce, agree
