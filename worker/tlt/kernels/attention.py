"""Kernel 2 of a layer: attention of each new token over its cache row with the engine's boolean mask, leaving the
normalised output [M, Hq * D] in the model dtype (what SDPA would return), ready for o_proj.

One program per (token, KV head) handles the G = Hq / Hkv query heads sharing that KV head (padded to 16 rows for
tl.dot) with an online softmax over blocks of BLOCK_N columns, from column 0 up to the token's own write column
(decode: its position; tree verify: nodes come in topological order, so ancestors sit left of it), skipping the
columns its mask row forbids. The walk starts at column 0 in fixed blocks and stops at the token's column, so a
token's output depends neither on the batch nor on the mask width Tk. (A column split over programs,
flash-decoding, was dropped: merging the splits inside o_proj re-read every split's partials for each output
tile.) Tests: `python -m pytest tests/kernels/test_kernels_layer.py -q`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from worker.tlt.kernels.common import Config, config_for, dot_precision

EMPTY_MAX = -1.0e30  # running max before any allowed column (finite: exp(EMPTY_MAX - m) is exactly 0, no NaN)


@triton.jit
def _attention_kernel(
    q_ptr, ck_ptr, cv_ptr, mask_ptr, widx_ptr, out_ptr,
    S, row0, Tk, sm_scale,
    stride_cr, stride_ch, stride_ct, stride_mb, stride_ms, stride_mt,
    NQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, EMPTY_MAX: tl.constexpr,
):
    m = tl.program_id(0)  # token (b * S + s)
    kvh = tl.program_id(1)
    b = m // S
    s = m % S
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < G
    offs_d = tl.arange(0, D)
    heads = m * (NQ * D) + (kvh * G + offs_g)[:, None] * D + offs_d[None, :]  # [BG, D] into [M, Hq * D]
    q = tl.load(q_ptr + heads, mask=g_mask[:, None], other=0.0)
    kv_base = (row0 + b).to(tl.int64) * stride_cr + kvh * stride_ch  # int64: caches pass 2**31 elements
    n_cols = tl.minimum(tl.load(widx_ptr + m) + 1, Tk)  # never past the token's own column
    m_i = tl.full([BLOCK_G], EMPTY_MAX, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_range = cols < n_cols
        allowed = tl.load(mask_ptr + b * stride_mb + s * stride_ms + cols * stride_mt, mask=in_range, other=0)
        ok = in_range & (allowed != 0)
        kt = tl.load(ck_ptr + kv_base + cols[None, :] * stride_ct + offs_d[:, None], mask=in_range[None, :],
                     other=0.0)  # [D, BN]
        sc = tl.dot(q, kt, input_precision=DOT_PREC) * sm_scale  # [BG, BN]
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(cv_ptr + kv_base + cols[:, None] * stride_ct + offs_d[None, :], mask=in_range[:, None],
                    other=0.0)  # [BN, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row with no allowed column: zeros (never NaN)
    tl.store(out_ptr + heads, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def cache_attention(
    q: torch.Tensor,  # [M, Hq * D] tokens b * S + s
    ck: torch.Tensor,  # [slots, Hkv, T, D]
    cv: torch.Tensor,  # [slots, Hkv, T, D]
    mask: torch.Tensor,  # [B, S, Tk] bool over cache columns
    widx: torch.Tensor,  # [M] int64 each token's own cache column
    *, row0: int, config: Config | None = None,  # config: the sweep's candidate (default: config_for)
) -> torch.Tensor:  # [M, Hq * D] in q's dtype
    m = q.shape[0]
    _, n_kv, _, d = ck.shape
    g = q.shape[1] // (n_kv * d)
    cfg = config or config_for("attention", g, d, q.device)
    out = torch.empty_like(q)
    mask_u8 = mask.view(torch.uint8)
    _attention_kernel[(m, n_kv)](
        q, ck, cv, mask_u8, widx, out,
        mask.shape[1], row0, mask.shape[2], 1.0 / math.sqrt(d),
        ck.stride(0), ck.stride(1), ck.stride(2), mask_u8.stride(0), mask_u8.stride(1), mask_u8.stride(2),
        NQ=g * n_kv, G=g, D=d, DOT_PREC=dot_precision(q.dtype), BLOCK_G=max(16, triton.next_power_of_2(g)),
        BLOCK_N=cfg.block_n, EMPTY_MAX=EMPTY_MAX, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
