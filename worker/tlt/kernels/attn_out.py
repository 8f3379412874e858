"""Kernel 3 of a layer: merge the attention chunks (kernels/attention.py) + o_proj GEMM + residual add, as one
launch: while loading each input tile the program merges that tile's chunk partials (flash-decoding's reduction:
out = sum_c acc_c * exp(max_c - top) / sum_c sum_c' * exp(max_c - top)), rounds it to the model dtype as torch's
attention output would be, and multiplies. Chunks are merged in column order and empty ones add exact zeros, so a
row's result never depends on the batch. Tests: `python -m pytest tests/kernels/test_kernels_layer.py -q`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.tlt.kernels.attention import EMPTY_MAX, Partials
from worker.tlt.kernels.common import BLOCK_M, block_k, block_n, dot_precision, rounded


@triton.jit(do_not_specialize=["M"])
def _attn_out_kernel(
    acc_ptr, max_ptr, sum_ptr, w_ptr, r_ptr, out_ptr, M, N, n_chunks, stride_wn, stride_rm, stride_om,
    NQ: tl.constexpr, D: tl.constexpr, EMPTY_MAX: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    dt = out_ptr.dtype.element_ty
    out = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, NQ * D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < NQ * D
        mk = m_mask[:, None] & k_mask[None, :]
        head = offs_m[:, None] * (n_chunks * NQ) + (offs_k // D)[None, :]  # [M, C, Hq] index of chunk 0
        top = tl.full([BLOCK_M, BLOCK_K], EMPTY_MAX, dtype=tl.float32)
        for c in range(0, n_chunks):
            top = tl.maximum(top, tl.load(max_ptr + head + c * NQ, mask=mk, other=EMPTY_MAX))
        num = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        den = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for c in range(0, n_chunks):
            wgt = tl.exp(tl.load(max_ptr + head + c * NQ, mask=mk, other=EMPTY_MAX) - top)
            den += tl.load(sum_ptr + head + c * NQ, mask=mk, other=0.0) * wgt
            num += tl.load(acc_ptr + (head + c * NQ) * D + (offs_k % D)[None, :], mask=mk, other=0.0) * wgt
        a = (num / tl.where(den > 0, den, 1.0)).to(dt)  # the attention output tile in the model dtype
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)  # [BK, BN]
        out += tl.dot(a, w, input_precision=DOT_PREC)
    mn_mask = m_mask[:, None] & n_mask[None, :]
    r = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mn_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], (rounded(out, dt) + r).to(dt), mask=mn_mask)


def attn_out_residual(parts: Partials, w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """r + merge(parts) @ w^T: parts of [M, C, Hq, D], w [N, Hq * D] (o_proj), r [M, N] -> [M, N] (a new tensor)."""
    m, n_chunks, n_heads, d = parts.acc.shape
    n = w.shape[0]
    assert w.stride(1) == 1 and r.stride(1) == 1 and parts.acc.is_contiguous()
    out = torch.empty((m, n), device=r.device, dtype=r.dtype)
    bn = block_n(n)
    _attn_out_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, bn))](
        parts.acc, parts.max, parts.sum, w, r, out, m, n, n_chunks, w.stride(0), r.stride(0), out.stride(0),
        NQ=n_heads, D=d, EMPTY_MAX=EMPTY_MAX, DOT_PREC=dot_precision(w.dtype), BLOCK_M=BLOCK_M, BLOCK_N=bn,
        BLOCK_K=block_k(n_heads * d),
    )
    return out
