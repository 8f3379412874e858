"""Kernel 2 of a layer: attention of each new token over its cache row with the engine's boolean mask, leaving the
normalised output [M, Hq * D] in the model dtype (what SDPA would return), ready for o_proj.

A program handles the G = Hq / Hkv query heads sharing one KV head (padded to 16 rows for tl.dot) with an online
softmax over blocks of BLOCK_N columns, from column 0 up to the token's own write column (decode: its position; tree
verify: nodes come in topological order, so ancestors sit left of it), skipping the columns its mask row forbids.

Split (config.split = SPLIT > 0, flash-decoding): at 1 token, one program per (token, KV head) is 3 programs for
SmolLM2, each walking the whole context serially. So a third grid axis cuts a token's columns into fixed chunks
[j * SPLIT, (j + 1) * SPLIT): its active splits are cdiv(n_cols, SPLIT), and split programs past them return at once.
Each active split writes fp32 partials (acc [G, D], running max m [G], sum l [G]) to scratch and bumps the
(token, KV head) counter; the last to arrive merges the partials in split order 0..n-1 (deterministic whatever the
arrival order), writes the output and resets the counter to 0. A token with one active split skips all that and
writes acc / l itself: exactly the unsplit kernel's result.

PDL (kernels/common.py): a split loads its first block of K / V and its mask into registers before waiting on the
previous kernel, all but the columns this call writes (the row's tokens write at columns >= its first token's, and
only qkv_rope, the kernel this one may overlap, writes them): those are loaded after the wait.

Batch invariance: chunk boundaries, block starts and the merge order depend on SPLIT / BLOCK_N and the token's own
column only, never on the batch or on the mask width Tk (Tk only sizes the grid: extra splits return at once).
Tests: `python -m pytest tests/kernels/test_kernels_layer.py tests/kernels/test_kernels_split.py -q`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from worker.tlt.kernels.common import (
    Config,
    block_table,
    dot_precision,
    kv_columns,
    pdl_args,
    prefetch,
    prefetch_lines,
    wait_for_previous,
)
from worker.tlt.kernels.tuning import config_for

EMPTY_MAX = -1.0e30  # running max before any allowed column (finite: exp(EMPTY_MAX - m) is exactly 0, no NaN)


@triton.jit
def _online_block(q, kt, v, ok, m_i, l_i, acc, sm_scale, DOT_PREC: tl.constexpr):
    """One block of the online softmax: q [BG, D] against kt [D, BN] / v [BN, D], columns `ok` [BN] allowed."""
    sc = tl.dot(q, kt, input_precision=DOT_PREC) * sm_scale  # [BG, BN]
    sc = tl.where(ok[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _attention_kernel(
    q_ptr, ck_ptr, cv_ptr, bt_ptr, mask_ptr, widx_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr,
    S, row0, Tk, n_splits, sm_scale,
    stride_cr, stride_ch, stride_ct, stride_bt, stride_mb, stride_ms, stride_mt,
    PAGE: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, EMPTY_MAX: tl.constexpr,
    USE_GDC: tl.constexpr, KV_LINES: tl.constexpr, EPL: tl.constexpr,
):
    m = tl.program_id(0)  # token (b * S + s)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = m // S
    s = m % S
    # widx is read before the PDL wait on purpose: the forward's input, written before its first layer, never by the
    # kernel this one may overlap; so splits past the token's columns leave at once, without waiting
    n_cols = tl.minimum(tl.load(widx_ptr + m) + 1, Tk)  # never past the token's own column
    if SPLIT == 0:
        n_active = 1
        lo = 0
        hi = n_cols
    else:
        n_active = tl.cdiv(n_cols, SPLIT)
        lo = split * SPLIT
        hi = tl.minimum(lo + SPLIT, n_cols)
    if USE_GDC and SPLIT > 0 and KV_LINES > 0 and split < n_active:  # this split's K and V lines into L2 while
        # the previous kernel (qkv_rope) runs: it writes only the token's own column, which the prefetch may miss
        c = tl.minimum(lo + tl.arange(0, SPLIT), hi - 1)
        kv = kv_columns(bt_ptr, row0 + b, stride_bt, c, c >= 0, PAGE, stride_cr, stride_ct) + kvh * stride_ch
        kv = kv[:, None] + (tl.arange(0, KV_LINES) * EPL)[None, :]
        prefetch(ck_ptr + kv)
        prefetch(cv_ptr + kv)
    if split < n_active:  # splits past the token's columns do nothing (not even the counter)
        # the split's first block of K / V into registers before the wait, except the columns this call writes:
        # the row's tokens write at their own columns, all >= its first token's (decode: its position; verify:
        # lens + node; prefill: from 0), and only the kernel this one may overlap (qkv_rope) writes them; the mask
        # is the forward's input. Those fresh columns are loaded after the wait.
        fresh_from = tl.load(widx_ptr + b * S)
        cols0 = lo + tl.arange(0, BLOCK_N)
        in0 = cols0 < hi
        offs_d = tl.arange(0, D)
        # int64 offsets of the block's columns through the block table (caches pass 2**31 elements)
        at0 = kv_columns(bt_ptr, row0 + b, stride_bt, cols0, in0, PAGE, stride_cr, stride_ct) + kvh * stride_ch
        k_at = ck_ptr + at0[None, :] + offs_d[:, None]  # [D, BN]
        v_at = cv_ptr + at0[:, None] + offs_d[None, :]  # [BN, D]
        stable = in0 & (cols0 < fresh_from)
        kt = tl.load(k_at, mask=stable[None, :], other=0.0)
        v = tl.load(v_at, mask=stable[:, None], other=0.0)
        allowed = tl.load(mask_ptr + b * stride_mb + s * stride_ms + cols0 * stride_mt, mask=in0, other=0)
        wait_for_previous(USE_GDC)
        fresh = in0 & (cols0 >= fresh_from)
        kt = tl.where(fresh[None, :], tl.load(k_at, mask=fresh[None, :], other=0.0), kt)
        v = tl.where(fresh[:, None], tl.load(v_at, mask=fresh[:, None], other=0.0), v)
        offs_g = tl.arange(0, BLOCK_G)
        g_mask = offs_g < G
        heads = m * (NQ * D) + (kvh * G + offs_g)[:, None] * D + offs_d[None, :]  # [BG, D] into [M, Hq * D]
        q = tl.load(q_ptr + heads, mask=g_mask[:, None], other=0.0)
        m_i = tl.full([BLOCK_G], EMPTY_MAX, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
        m_i, l_i, acc = _online_block(q, kt, v, in0 & (allowed != 0), m_i, l_i, acc, sm_scale, DOT_PREC)
        for start in range(lo + BLOCK_N, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            in_range = cols < hi
            allowed = tl.load(mask_ptr + b * stride_mb + s * stride_ms + cols * stride_mt, mask=in_range, other=0)
            at = kv_columns(bt_ptr, row0 + b, stride_bt, cols, in_range, PAGE, stride_cr, stride_ct) + kvh * stride_ch
            kt = tl.load(ck_ptr + at[None, :] + offs_d[:, None], mask=in_range[None, :], other=0.0)  # [D, BN]
            v = tl.load(cv_ptr + at[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)  # [BN, D]
            m_i, l_i, acc = _online_block(q, kt, v, in_range & (allowed != 0), m_i, l_i, acc, sm_scale, DOT_PREC)
        if n_active == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row with no allowed column: zeros (never NaN)
            tl.store(out_ptr + heads, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            pair = m * NKV + kvh
            gd = offs_g[:, None] * D + offs_d[None, :]
            slot = pair * n_splits + split  # scratch [M * Hkv * n_splits, G, D] and [.., 2, G] (m, l)
            tl.store(part_acc_ptr + slot * (G * D) + gd, acc, mask=g_mask[:, None])
            tl.store(part_ml_ptr + slot * (2 * G) + offs_g, m_i, mask=g_mask)
            tl.store(part_ml_ptr + slot * (2 * G) + G + offs_g, l_i, mask=g_mask)
            # acq_rel: this split's partials are visible before its count; the last arriver sees everyone's
            arrived = tl.atomic_add(counter_ptr + pair, 1, sem="acq_rel")
            if arrived == n_active - 1:
                first = pair * n_splits
                m_all = tl.full([BLOCK_G], EMPTY_MAX, dtype=tl.float32)
                for j in range(0, n_active):  # .cg: read from L2, where the other SMs' partials landed
                    m_j = tl.load(part_ml_ptr + (first + j) * (2 * G) + offs_g, mask=g_mask, other=EMPTY_MAX,
                                  cache_modifier=".cg")
                    m_all = tl.maximum(m_all, m_j)
                l_all = tl.zeros([BLOCK_G], dtype=tl.float32)
                acc_all = tl.zeros([BLOCK_G, D], dtype=tl.float32)
                for j in range(0, n_active):  # split order: the same sum whatever order the splits finished in
                    ml = part_ml_ptr + (first + j) * (2 * G)
                    m_j = tl.load(ml + offs_g, mask=g_mask, other=EMPTY_MAX, cache_modifier=".cg")
                    l_j = tl.load(ml + G + offs_g, mask=g_mask, other=0.0, cache_modifier=".cg")
                    acc_j = tl.load(part_acc_ptr + (first + j) * (G * D) + gd, mask=g_mask[:, None], other=0.0,
                                    cache_modifier=".cg")
                    scale = tl.exp(m_j - m_all)  # an empty split (m_j = EMPTY_MAX, l_j = 0) adds nothing
                    l_all += l_j * scale
                    acc_all += acc_j * scale[:, None]
                out = acc_all / tl.where(l_all > 0, l_all, 1.0)[:, None]
                tl.store(out_ptr + heads, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
                tl.store(counter_ptr + pair, 0)  # every split has counted: ready for the next launch


# Per-device arrival counters of the split kernel, one int32 per (token, KV head), all 0 between launches (the last
# arriver resets its own). Every launch on a device shares the buffer, which is safe because the kernels using it run
# stream-ordered (one stream: decode and verify forwards, eager or graph replays); two attention launches running
# concurrently on two streams of one device would race on it. Grown outside graph capture only (a capture must
# follow an eager warm-up of the same shapes, as rollout/graphs.py does); a replaced buffer is kept alive, as
# captured graphs still point at it.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
MIN_COUNTERS = 1 << 16  # 256 KiB: M * Hkv of any verify call the engine makes, so it never grows in practice


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """The device's counter buffer (>= n int32 zeros), allocated or grown here, never during a CUDA graph capture."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split attention needs {n} counters but has {0 if buf is None else buf.numel()}: "
                               "run the forward once eagerly (same shapes) before capturing it")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, MIN_COUNTERS, 2 * (0 if buf is None else buf.numel())), dtype=torch.int32,
                          device=device)
        _COUNTERS[device] = buf
    return buf


def cache_attention(
    q: torch.Tensor,  # [M, Hq * D] tokens b * S + s
    ck: torch.Tensor,  # [n_pages, Hkv, P, D] (the row layout: [slots, Hkv, T, D])
    cv: torch.Tensor,  # [n_pages, Hkv, P, D]
    mask: torch.Tensor,  # [B, S, Tk] bool over cache columns
    widx: torch.Tensor,  # [M] int64 each token's own cache column
    *, row0: int, config: Config | None = None,  # config: the sweep's candidate (default: config_for)
    table: torch.Tensor | None = None,  # [slots, pages_per_row] int32 block table (None: the row layout's identity)
) -> torch.Tensor:  # [M, Hq * D] in q's dtype
    m = q.shape[0]
    table, page = block_table(table, ck)
    _, n_kv, _, d = ck.shape
    g = q.shape[1] // (n_kv * d)
    tk = mask.shape[2]
    cfg = config or config_for("attention", g, d, q.device,
                               launch=lambda c: cache_attention(q[:1], ck, cv, mask[:1, :1], widx[:1], row0=row0,
                                                                config=c, table=table))  # tuned on the call's first token
    split = max(cfg.split, 0)
    n_splits = triton.cdiv(tk, split) if split else 1  # enough for any row (n_cols <= Tk); the extra ones return
    out = torch.empty_like(q)
    if n_splits > 1:  # (one split: no row has two chunks, no scratch is touched)
        part_acc = torch.empty((m * n_kv * n_splits, g, d), device=q.device, dtype=torch.float32)
        part_ml = torch.empty((m * n_kv * n_splits, 2, g), device=q.device, dtype=torch.float32)
        counters = split_counters(q.device, m * n_kv)
    else:
        part_acc = part_ml = counters = out  # not read
    mask_u8 = mask.view(torch.uint8)
    kv_lines, epl = prefetch_lines(d, ck)  # a cache column of D elements spans kv_lines 128-byte lines
    _attention_kernel[(m, n_kv, n_splits)](
        q, ck, cv, table, mask_u8, widx, out, part_acc, part_ml, counters,
        mask.shape[1], row0, tk, n_splits, 1.0 / math.sqrt(d),
        ck.stride(0), ck.stride(1), ck.stride(2), table.stride(0), mask_u8.stride(0), mask_u8.stride(1),
        mask_u8.stride(2), PAGE=page, NQ=g * n_kv, NKV=n_kv, G=g, D=d, DOT_PREC=dot_precision(q.dtype), BLOCK_G=max(16, triton.next_power_of_2(g)),
        BLOCK_N=cfg.block_n, SPLIT=split, EMPTY_MAX=EMPTY_MAX, KV_LINES=kv_lines, EPL=epl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_args(q.device, m),
    )
    return out
