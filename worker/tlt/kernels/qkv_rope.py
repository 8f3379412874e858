"""Kernel 1 of a layer: input RMSNorm (or none: the EAGLE-1 drafter's layer) + fused q|k|v projection (+ bias,
Qwen2) (+ per-head q/k RMSNorm, Qwen3) + RoPE, storing q [M, Hq*D] and writing K and V straight into the KV cache
at (row, head, write column).

One program per (block of 16 tokens, tile of BLOCK_N output rows of one head): at 1 token, one program per head
(15 for SmolLM2) leaves most SMs idle, narrower tiles launch more. HF's rotate_half RoPE pairs column d with
d +- D/2, which a register tile cannot permute, so a tile is made of pairs: BLOCK_N / 2 rows of the head's first
half and their partners D/2 further on, two accumulators of the same dot products (bit-identical to a plain GEMM);
then out_a = y_a * cos_a + y_b * sin_a and out_b = y_b * cos_b + y_a * sin_b with the model's sign-folded sin table.
(An earlier layout computed every row's partner a second time: twice the weight reads and dots per program.) Each
half is padded to 16 columns where BLOCK_N / 2 is smaller (tl.dot's minimum). The q/k RMSNorm (Qwen3) needs all D
outputs of a head: a whole head per program there. Works for any power-of-2 head_dim >= 16. Without an input norm
(ln_w None: EAGLE-1's drafter layer reads fc's output raw) the GEMM reads the x tiles as they are.
Tests: `python -m pytest tests/kernels/test_kernels_layer.py tests/kernels/test_kernels_split.py -q`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.tlt.kernels.common import (
    BLOCK_M,
    Config,
    block_table,
    dot_precision,
    kv_columns,
    pair_dots,
    pair_first_tiles,
    pdl_args,
    prefetch_lines,
    rounded,
    wait_for_previous,
)
from worker.tlt.kernels.tuning import config_for


@triton.jit(do_not_specialize=["M"])
def _qkv_rope_kernel(
    x_ptr, ln_w_ptr, w_ptr, b_ptr, qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr, pos_ptr, widx_ptr,
    q_ptr, ck_ptr, cv_ptr, bt_ptr,
    M, K, S, row0, eps, MAX_POS,
    stride_xm, stride_wn, stride_rope, stride_cr, stride_ch, stride_ct, stride_bt,
    PAGE: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HALF_PAD: tl.constexpr, USE_GDC: tl.constexpr, LINES: tl.constexpr, EPL: tl.constexpr,
):
    # a tile of BLOCK_N output rows of one head h: BLOCK_N / 2 rows of its first half ("a") and their RoPE partners
    # D / 2 further on ("b"), each half padded to HALF_PAD >= 16 columns for tl.dot
    HALF: tl.constexpr = BLOCK_N // 2
    h = tl.program_id(1) * BLOCK_N // D
    tile = tl.program_id(1) % (D // BLOCK_N)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    j = tl.arange(0, HALF_PAD)
    real = j < HALF
    offs_a = tile * HALF + tl.minimum(j, HALF - 1)  # columns within the head (padding repeats the last: in range)
    offs_b = offs_a + D // 2
    rows_a = h * D + offs_a
    rows_b = h * D + offs_b
    dt = q_ptr.dtype.element_ty
    # the first K tile of the weights into registers before the wait; the tiles accumulate in a plain loop's order
    w_a, w_b = pair_first_tiles(w_ptr, rows_a, rows_b, real, K, stride_wn, BLOCK_K, USE_GDC, LINES, EPL)
    # RoPE rows and cache columns too: positions and write columns are the forward's inputs, written before its
    # first kernel, never by the kernel this one may overlap (as attention's widx)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + offs_m, mask=m_mask, other=0), 0), MAX_POS)  # in the table
    col = tl.load(widx_ptr + offs_m, mask=m_mask, other=0)
    rope = pos[:, None] * stride_rope
    cos_a = rounded(tl.load(cos_ptr + rope + offs_a[None, :], mask=m_mask[:, None], other=0.0), dt)
    sin_a = rounded(tl.load(sin_ptr + rope + offs_a[None, :], mask=m_mask[:, None], other=0.0), dt)
    cos_b = rounded(tl.load(cos_ptr + rope + offs_b[None, :], mask=m_mask[:, None], other=0.0), dt)
    sin_b = rounded(tl.load(sin_ptr + rope + offs_b[None, :], mask=m_mask[:, None], other=0.0), dt)
    wait_for_previous(USE_GDC)
    acc_a, acc_b = pair_dots(x_ptr, ln_w_ptr, stride_xm, offs_m, m_mask, K, eps, w_ptr, rows_a, rows_b, real,
                             stride_wn, w_a, w_b, dt, HAS_NORM, DOT_PREC, BLOCK_M, BLOCK_K)
    if HAS_BIAS:
        acc_a += tl.load(b_ptr + rows_a).to(tl.float32)[None, :]
        acc_b += tl.load(b_ptr + rows_b).to(tl.float32)[None, :]
    y_a = rounded(acc_a, dt)  # the projection's output in the model dtype
    y_b = rounded(acc_b, dt)
    # head type (a tile lies in one head) as [HALF_PAD] vectors: masks and selects stay tensors of one shape
    head = h + 0 * j
    is_q = head < NQ
    is_v = head >= NQ + NKV
    if QK_NORM:  # per-head RMSNorm over the D outputs (q_norm for q heads, k_norm for k heads); BLOCK_N == D
        ss = tl.sum(tl.where(real[None, :], y_a * y_a + y_b * y_b, 0.0), axis=1)
        rs = 1.0 / tl.sqrt(ss / D + eps)
        nw_a = tl.where(is_q, tl.load(qn_w_ptr + offs_a), tl.load(kn_w_ptr + offs_a)).to(tl.float32)
        nw_b = tl.where(is_q, tl.load(qn_w_ptr + offs_b), tl.load(kn_w_ptr + offs_b)).to(tl.float32)
        y_a = tl.where(is_v[None, :], y_a, rounded(rounded(y_a * rs[:, None], dt) * nw_a[None, :], dt))
        y_b = tl.where(is_v[None, :], y_b, rounded(rounded(y_b * rs[:, None], dt) * nw_b[None, :], dt))
    # HF's apply_rope (x * cos, then addcmul with rotate_half(x) and the sign-folded sin); v rows pass through
    out_a = tl.where(is_v[None, :], y_a, rounded(y_a * cos_a, dt) + y_b * sin_a)
    out_b = tl.where(is_v[None, :], y_b, rounded(y_b * cos_b, dt) + y_a * sin_b)
    store = m_mask[:, None] & real[None, :]
    q_row = offs_m[:, None] * (NQ * D)
    tl.store(q_ptr + q_row + rows_a[None, :], out_a.to(dt), mask=store & is_q[None, :])
    tl.store(q_ptr + q_row + rows_b[None, :], out_b.to(dt), mask=store & is_q[None, :])
    # K / V: cache[row0 + m // S, kv head, write_idx[m], :] through the block table (int64 offsets)
    base = kv_columns(bt_ptr, row0 + offs_m // S, stride_bt, col, m_mask, PAGE, stride_cr, stride_ct)
    kvh = tl.maximum(tl.where(is_v, head - NQ - NKV, head - NQ), 0)  # q heads: masked, kept in range
    at = base[:, None] + (kvh * stride_ch)[None, :]
    is_k = ~is_q & ~is_v
    tl.store(ck_ptr + at + offs_a[None, :], out_a.to(ck_ptr.dtype.element_ty), mask=store & is_k[None, :])
    tl.store(ck_ptr + at + offs_b[None, :], out_b.to(ck_ptr.dtype.element_ty), mask=store & is_k[None, :])
    tl.store(cv_ptr + at + offs_a[None, :], out_a.to(cv_ptr.dtype.element_ty), mask=store & is_v[None, :])
    tl.store(cv_ptr + at + offs_b[None, :], out_b.to(cv_ptr.dtype.element_ty), mask=store & is_v[None, :])


def head_tile(block_n: int, d: int, *, qk_norm: bool) -> int:
    """Output rows per program: config.block_n, or the whole head (block_n 0 or past D, or a per-head q/k norm that
    needs all D outputs in one program)."""
    if qk_norm or block_n <= 0 or block_n >= d:
        return d
    assert block_n >= 16 and d % block_n == 0 and block_n & (block_n - 1) == 0, f"qkv_rope block_n {block_n}, D {d}"
    return block_n


def qkv_rope_cache(
    x: torch.Tensor,  # [M, H] hidden entering the layer (contiguous)
    ln_w: torch.Tensor | None,  # [H] input_layernorm weight; None: no input norm (EAGLE-1's drafter layer)
    w: torch.Tensor,  # [(Hq + 2 Hkv) * D, H] fused q|k|v weight
    bias: torch.Tensor | None,  # [(Hq + 2 Hkv) * D] or None
    q_norm: torch.Tensor | None,  # [D] (Qwen3) or None
    k_norm: torch.Tensor | None,  # [D]
    cos: torch.Tensor,  # [T, D] fp32 rope table
    sin: torch.Tensor,  # [T, D] fp32 sign-folded
    pos: torch.Tensor,  # [M] int64 RoPE positions (clamped into the table's rows)
    widx: torch.Tensor,  # [M] int64 cache column of each token
    ck: torch.Tensor,  # [n_pages, Hkv, P, D] this layer's K pages (written; row layout [slots, Hkv, T, D])
    cv: torch.Tensor,  # [n_pages, Hkv, P, D] V pages (written)
    *, s: int, row0: int, n_heads: int, eps: float,
    config: Config | None = None,  # the sweep's candidate (default: config_for)
    table: torch.Tensor | None = None,  # [slots, pages_per_row] int32 block table (None: the row layout's identity)
) -> torch.Tensor:  # q [M, Hq * D] after RoPE
    m, k = x.shape
    table, page = block_table(table, ck)
    n_kv, d = ck.shape[1], ck.shape[3]
    assert ck.stride(3) == 1 and cv.stride() == ck.stride() and w.stride(1) == 1 and cos.stride(1) == 1
    assert pos.is_contiguous() and widx.is_contiguous()  # read as flat [M] arrays
    cfg = config or config_for(  # a first use tunes on the call's first token (rewriting its K/V as they are)
        "qkv_rope", w.shape[0], k, x.device,
        launch=lambda c: qkv_rope_cache(x[:1], ln_w, w, bias, q_norm, k_norm, cos, sin, pos[:1], widx[:1], ck, cv, s=s,
                                        row0=row0, n_heads=n_heads, eps=eps, config=c, table=table))
    block_n = head_tile(cfg.block_n, d, qk_norm=q_norm is not None)
    # a whole head where the config meant a narrower tile: two [BLOCK_K, D] weight tiles per step, half as deep
    block_k = cfg.block_k if block_n == cfg.block_n else min(cfg.block_k, 128)
    q = torch.empty((m, n_heads * d), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, BLOCK_M), (n_heads + 2 * n_kv) * d // block_n)
    ln = ln_w if ln_w is not None else w  # unused pointers get any tensor
    lines, epl = prefetch_lines(k, w, cfg.prefetch)
    _qkv_rope_kernel[grid](
        x, ln, w, bias if bias is not None else w, q_norm if q_norm is not None else ln,
        k_norm if k_norm is not None else ln, cos, sin, pos, widx, q, ck, cv, table,
        m, k, s, row0, eps, cos.shape[0] - 1,
        x.stride(0), w.stride(0), cos.stride(0), ck.stride(0), ck.stride(1), ck.stride(2), table.stride(0),
        PAGE=page, NQ=n_heads, NKV=n_kv, D=d, HAS_NORM=ln_w is not None, HAS_BIAS=bias is not None, QK_NORM=q_norm is not None,
        DOT_PREC=dot_precision(w.dtype), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        HALF_PAD=max(16, block_n // 2), LINES=lines, EPL=epl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device, m),
    )
    return q
