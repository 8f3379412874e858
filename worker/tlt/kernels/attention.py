"""Kernel 2 of a layer: attention of each new token over its cache row with the engine's boolean mask, split over
the cache columns (flash-decoding): a batch-1 decode step has only Hkv programs per layer otherwise, each walking
the whole context alone.

One program per (token, KV head, chunk of CHUNK columns) handles the G = Hq / Hkv query heads sharing that KV head
(padded to 16 rows for tl.dot), with an online softmax over blocks of BLOCK_N columns, and leaves its partial
(unnormalised output, running max, running sum) in fp32 scratch; the o_proj kernel (kernels/attn_out.py) merges the
chunks while it loads its input, so the split costs no extra launch. A token only reads columns up to its own write
column (decode: its position; tree verify: nodes come in topological order, so ancestors sit left of it) and only
those its mask row allows. Chunks sit at fixed columns (multiples of CHUNK) and chunks past a token's column are
empty (they merge as exact zeros), so a token's output depends neither on the batch nor on the mask width Tk.
Tests: `python -m pytest tests/kernels/test_kernels_layer.py -q`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from worker.tlt.kernels.common import dot_precision

BLOCK_N = 64  # cache columns per step
CHUNK = 128  # cache columns per program (a multiple of BLOCK_N)
EMPTY_MAX = -1.0e30  # running max of a chunk with no allowed column (finite: exp(EMPTY_MAX - m) is exactly 0)


class Partials(NamedTuple):
    acc: torch.Tensor  # [M, C, Hq, D] fp32 unnormalised output per chunk
    max: torch.Tensor  # [M, C, Hq] fp32 running max of the scaled scores
    sum: torch.Tensor  # [M, C, Hq] fp32 sum of exp(score - max)


@triton.jit
def _attention_kernel(
    q_ptr, ck_ptr, cv_ptr, mask_ptr, widx_ptr, acc_ptr, max_ptr, sum_ptr,
    S, row0, Tk, n_chunks, sm_scale,
    stride_cr, stride_ch, stride_ct, stride_mb, stride_ms, stride_mt,
    NQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, EMPTY_MAX: tl.constexpr,
):
    m = tl.program_id(0)  # token (b * S + s)
    kvh = tl.program_id(1)
    chunk = tl.program_id(2)
    b = m // S
    s = m % S
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < G
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + m * (NQ * D) + (kvh * G + offs_g)[:, None] * D + offs_d[None, :], mask=g_mask[:, None],
                other=0.0)  # [BG, D]
    kv_base = (row0 + b).to(tl.int64) * stride_cr + kvh * stride_ch  # int64: caches pass 2**31 elements
    n_cols = tl.minimum(tl.load(widx_ptr + m) + 1, Tk)  # never past the token's own column
    end = tl.minimum(n_cols, (chunk + 1) * CHUNK)
    m_i = tl.full([BLOCK_G], EMPTY_MAX, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    for start in range(chunk * CHUNK, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_range = cols < end
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
    head = (m * n_chunks + chunk) * NQ + kvh * G + offs_g  # index into [M, C, Hq]
    tl.store(max_ptr + head, m_i, mask=g_mask)
    tl.store(sum_ptr + head, l_i, mask=g_mask)
    tl.store(acc_ptr + head[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])


def cache_attention(
    q: torch.Tensor,  # [M, Hq * D] tokens b * S + s
    ck: torch.Tensor,  # [slots, Hkv, T, D]
    cv: torch.Tensor,  # [slots, Hkv, T, D]
    mask: torch.Tensor,  # [B, S, Tk] bool over cache columns
    widx: torch.Tensor,  # [M] int64 each token's own cache column
    *, row0: int,
) -> Partials:
    m = q.shape[0]
    _, n_kv, _, d = ck.shape
    g = q.shape[1] // (n_kv * d)
    n_chunks = triton.cdiv(mask.shape[2], CHUNK)
    parts = Partials(*(torch.empty(shape, device=q.device, dtype=torch.float32)
                       for shape in ((m, n_chunks, g * n_kv, d), (m, n_chunks, g * n_kv), (m, n_chunks, g * n_kv))))
    mask_u8 = mask.view(torch.uint8)
    _attention_kernel[(m, n_kv, n_chunks)](
        q, ck, cv, mask_u8, widx, parts.acc, parts.max, parts.sum,
        mask.shape[1], row0, mask.shape[2], n_chunks, 1.0 / math.sqrt(d),
        ck.stride(0), ck.stride(1), ck.stride(2), mask_u8.stride(0), mask_u8.stride(1), mask_u8.stride(2),
        NQ=g * n_kv, G=g, D=d, DOT_PREC=dot_precision(q.dtype), BLOCK_G=max(16, triton.next_power_of_2(g)),
        BLOCK_N=BLOCK_N, CHUNK=CHUNK, EMPTY_MAX=EMPTY_MAX,
    )
    return parts


def merge_partials(parts: Partials) -> torch.Tensor:  # -> [M, Hq * D] fp32
    """The attention output from the chunks' partials, in torch (what kernels/attn_out.py does in its prologue)."""
    top = parts.max.max(dim=1, keepdim=True).values  # [M, 1, Hq]
    w = torch.exp(parts.max - top)  # [M, C, Hq]
    out = (parts.acc * w[..., None]).sum(1) / (parts.sum * w).sum(1).clamp_min(1e-30)[..., None]
    return out.reshape(out.shape[0], -1)
