"""The small kernels between the cuBLAS GEMMs of `gemm_forward_hidden` (kernels/gemm_forward.py), one launch each
where torch needs two to six:

  add_rms_norm   s = x + r; y = RMSNorm(s)   (a layer's residual add and the next norm; r None: the first norm)
  rope_cache     q/k RMSNorm (Qwen3) + RoPE over the q|k|v projection, q out, K and V written into the cache
  silu_mul       silu(gate) * up from the gate|up projection

Each rounds where torch rounds (outputs in the model dtype, arithmetic in fp32), so that the forward matches
`Transformer.forward_hidden` op for op. One program per token (per (token, head) for rope_cache): at decode sizes
these are a few microseconds each. Tests: `python -m pytest tests/kernels/test_kernels_gemm_forward.py -q`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.tlt.kernels.common import block_table, kv_columns, rounded


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, K, eps, stride_x, stride_r,
                         HAS_R: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < K
    dt = y_ptr.dtype.element_ty
    s = tl.load(x_ptr + m * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_R:
        s = rounded(s + tl.load(r_ptr + m * stride_r + offs, mask=ok, other=0.0).to(tl.float32), dt)
        tl.store(s_ptr + m * K + offs, s.to(dt), mask=ok)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / K + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * K + offs, (rounded(s * rstd, dt) * w).to(dt), mask=ok)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = x + r rounded (x itself when r is None), y = w * rms_norm(s) as RMSNorm computes it. [M, K]."""
    m, k = x.shape
    assert x.stride(1) == 1 and (r is None or (r.stride(1) == 1 and r.shape == x.shape))
    y = torch.empty((m, k), device=x.device, dtype=x.dtype)
    s = torch.empty_like(y) if r is not None else x
    _add_rms_norm_kernel[(m,)](x, r if r is not None else x, w, s, y, k, eps, x.stride(0),
                               r.stride(0) if r is not None else 0, HAS_R=r is not None,
                               BLOCK=triton.next_power_of_2(k), num_warps=4 if k <= 4096 else 8)
    return s, y


@triton.jit
def _rope_cache_kernel(qkv_ptr, qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr, pos_ptr, widx_ptr, q_ptr, ck_ptr, cv_ptr,
                       bt_ptr, S, row0, eps, MAX_POS, stride_qkv, stride_rope, stride_cr, stride_ch, stride_ct,
                       stride_bt, PAGE: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr):
    m = tl.program_id(0)
    h = tl.program_id(1)  # q heads, then k heads, then v heads
    dt = q_ptr.dtype.element_ty
    j = tl.arange(0, D // 2)
    src = qkv_ptr + m * stride_qkv + h * D
    y_a = tl.load(src + j).to(tl.float32)  # the head's first half and its RoPE partners D / 2 further on
    y_b = tl.load(src + j + D // 2).to(tl.float32)
    col = tl.load(widx_ptr + m)
    at = kv_columns(bt_ptr, row0 + m // S, stride_bt, col, col >= 0, PAGE, stride_cr, stride_ct)  # via the table
    if h >= NQ + NKV:  # v: straight into the cache
        at += (h - NQ - NKV) * stride_ch
        tl.store(cv_ptr + at + j, y_a.to(cv_ptr.dtype.element_ty))
        tl.store(cv_ptr + at + j + D // 2, y_b.to(cv_ptr.dtype.element_ty))
    else:
        if QK_NORM:  # the head's RMSNorm over its D outputs, q_norm or k_norm
            rs = 1.0 / tl.sqrt(tl.sum(y_a * y_a + y_b * y_b, axis=0) / D + eps)
            nw_ptr = qn_w_ptr if h < NQ else kn_w_ptr
            y_a = rounded(rounded(y_a * rs, dt) * tl.load(nw_ptr + j).to(tl.float32), dt)
            y_b = rounded(rounded(y_b * rs, dt) * tl.load(nw_ptr + j + D // 2).to(tl.float32), dt)
        pos = tl.minimum(tl.maximum(tl.load(pos_ptr + m), 0), MAX_POS) * stride_rope
        cos_a = rounded(tl.load(cos_ptr + pos + j), dt)
        cos_b = rounded(tl.load(cos_ptr + pos + j + D // 2), dt)
        sin_a = rounded(tl.load(sin_ptr + pos + j), dt)
        sin_b = rounded(tl.load(sin_ptr + pos + j + D // 2), dt)
        # apply_rope: x * cos rounded, then the addcmul with rotate_half(x) and the sign-folded sin
        out_a = rounded(y_a * cos_a, dt) + y_b * sin_a
        out_b = rounded(y_b * cos_b, dt) + y_a * sin_b
        if h < NQ:
            dst = q_ptr + m * (NQ * D) + h * D
            tl.store(dst + j, out_a.to(dt))
            tl.store(dst + j + D // 2, out_b.to(dt))
        else:
            at += (h - NQ) * stride_ch
            tl.store(ck_ptr + at + j, out_a.to(ck_ptr.dtype.element_ty))
            tl.store(ck_ptr + at + j + D // 2, out_b.to(ck_ptr.dtype.element_ty))


def rope_cache(
    qkv: torch.Tensor,  # [M, (Hq + 2 Hkv) * D] the projection's output (bias added)
    q_norm: torch.Tensor | None,  # [D] (Qwen3) or None
    k_norm: torch.Tensor | None,  # [D]
    cos: torch.Tensor,  # [T, D] fp32 rope table
    sin: torch.Tensor,  # [T, D] fp32 sign-folded
    pos: torch.Tensor,  # [M] int64 RoPE positions
    widx: torch.Tensor,  # [M] int64 cache column of each token
    ck: torch.Tensor,  # [n_pages, Hkv, P, D] written (row layout [slots, Hkv, T, D])
    cv: torch.Tensor,  # [n_pages, Hkv, P, D] written
    *, s: int, row0: int, n_heads: int, eps: float,
    table: torch.Tensor | None = None,  # [slots, pages_per_row] int32 block table (None: the row layout's identity)
) -> torch.Tensor:  # q [M, Hq * D] after RoPE
    m = qkv.shape[0]
    table, page = block_table(table, ck)
    n_kv, d = ck.shape[1], ck.shape[3]
    assert qkv.stride(1) == 1 and ck.stride(3) == 1 and cv.stride() == ck.stride() and cos.stride(1) == 1
    assert pos.is_contiguous() and widx.is_contiguous() and qkv.shape[1] == (n_heads + 2 * n_kv) * d
    q = torch.empty((m, n_heads * d), device=qkv.device, dtype=qkv.dtype)
    nw = q_norm if q_norm is not None else cos  # unused pointers get any tensor
    _rope_cache_kernel[(m, n_heads + 2 * n_kv)](
        qkv, nw, k_norm if k_norm is not None else nw, cos, sin, pos, widx, q, ck, cv, table,
        s, row0, eps, cos.shape[0] - 1, qkv.stride(0), cos.stride(0), ck.stride(0), ck.stride(1), ck.stride(2),
        table.stride(0), PAGE=page, NQ=n_heads, NKV=n_kv, D=d, QK_NORM=q_norm is not None, num_warps=1,
    )
    return q


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, stride_gu, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + m * stride_gu + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + m * stride_gu + N + offs, mask=ok, other=0.0).to(tl.float32)
    act = rounded(g / (1.0 + tl.exp(-g)), dt)  # F.silu's output
    tl.store(out_ptr + m * N + offs, (act * u).to(dt), mask=ok)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gu = gate | up [M, 2I] -> [M, I], rounded as F.silu(gate) * up."""
    m, n2 = gu.shape
    n = n2 // 2
    assert gu.stride(1) == 1
    out = torch.empty((m, n), device=gu.device, dtype=gu.dtype)
    block = 2048
    _silu_mul_kernel[(m, triton.cdiv(n, block))](gu, out, n, gu.stride(0), BLOCK=block, num_warps=4)
    return out
