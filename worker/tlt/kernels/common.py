"""Pieces shared by the fused decode kernels: the RMSNorm prologue (sum of squares over a row, then the normalised
tile in the weight dtype, rounded as HF's RMSNorm rounds), the dtype round trip that mimics a torch op's output
rounding, and the block-size rules.

Block sizes depend on the weight shape (N, K) only, never on the number of tokens M, so that every row's result is
bit-identical whatever the batch (plain decode and speculative verify then agree exactly). Tests:
`python -m pytest tests/kernels -q`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tl.dot needs M tiles >= 16; decode batches are padded up to it by masks


def block_k(k: int) -> int:
    return max(16, min(64, triton.next_power_of_2(k)))


def block_n(n: int) -> int:
    # narrow column tiles: a decode GEMV is launch/latency-bound, so more programs (SMs) beat wider tiles
    return 16 if n <= 1024 else 32


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 weights: exact fp32 products (the default TF32 would break fp32 parity); else the native MMA."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def rounded(x, dt: tl.constexpr):
    """x (fp32) rounded to the model dtype and back: what a torch op returning `dt` would have stored."""
    return x.to(dt).to(tl.float32)


@triton.jit
def row_rstd(x_ptr, stride_xm, offs_m, m_mask, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of rows offs_m of x [M, K] (fp32): the whole row must be read before the GEMM loop can start."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def normed_tile(x_ptr, stride_xm, offs_m, m_mask, offs_k, K, rstd, w_ptr, dt: tl.constexpr):
    """RMSNorm(x)[offs_m, offs_k] in dtype dt as HF computes it: rms_norm rounded to dt, then times the weight."""
    k_mask = offs_k < K
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    return (rounded(x * rstd[:, None], dt) * w[None, :]).to(dt)
