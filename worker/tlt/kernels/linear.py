"""Kernels 4-5 of a layer: `linear_residual` (r + a @ W^T: down_proj with its residual add; without r, the lm head:
batch-invariant where cuBLAS picks a different kernel per batch size; with `gather`, its input is concat(table[ids], a):
an EAGLE-1 drafter's fc over concat(embed(token), feature) without the embedding gather and the concat) and
`norm_gate_up` (post-attention RMSNorm + gate|up projection + silu(gate) * up, each program computing matching
gate and up column tiles). Outputs are rounded where torch would round them (the projection's output, then the
add / the silu / the product), accumulation is fp32. Tests: `python -m pytest tests/kernels/test_kernels_layer.py -q`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker.tlt.kernels.common import (
    BLOCK_M,
    Config,
    dot_precision,
    pair_dots,
    pair_first_tiles,
    pdl_args,
    prefetch_lines,
    prefetch_rows,
    rounded,
    wait_for_previous,
    weight_tile_t,
)
from worker.tlt.kernels.tuning import config_for, prefers_torch


@triton.jit
def _input_tile(a_ptr, offs_m, m_mask, offs_k, K, stride_am):
    """a[offs_m, offs_k] as a [BM, BK] tile (zeros outside)."""
    return tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K),
                   other=0.0)


@triton.jit
def _gathered_input_tile(a_ptr, offs_m, m_mask, offs_k, K, stride_am, t_ptr, t_rows, KT, stride_t):
    """concat(table[t_rows], a)[offs_m, offs_k] as a [BM, BK] tile: columns < KT from the table rows, the rest from a
    (one of the two loads is masked off per column, so the sum is exact)."""
    left = offs_k[None, :] < KT
    x = tl.load(t_ptr + t_rows[:, None] * stride_t + offs_k[None, :], mask=m_mask[:, None] & left, other=0.0)
    y = tl.load(a_ptr + offs_m[:, None] * stride_am + (offs_k[None, :] - KT),
                mask=m_mask[:, None] & ~left & (offs_k[None, :] < K), other=0.0)
    return x + y


@triton.jit
def _any_input_tile(a_ptr, offs_m, m_mask, offs_k, K, stride_am, t_ptr, t_rows, KT, stride_t, GATHER: tl.constexpr):
    if GATHER:
        return _gathered_input_tile(a_ptr, offs_m, m_mask, offs_k, K, stride_am, t_ptr, t_rows, KT, stride_t)
    return _input_tile(a_ptr, offs_m, m_mask, offs_k, K, stride_am)


@triton.jit(do_not_specialize=["M"])
def _linear_residual_kernel(
    a_ptr, w_ptr, r_ptr, out_ptr, t_ptr, ids_ptr, M, N, K, KT, stride_am, stride_wn, stride_rm, stride_om, stride_t,
    HAS_RESIDUAL: tl.constexpr, EARLY_R: tl.constexpr, GATHER: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr, LINES: tl.constexpr,
    EPL: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if USE_GDC:
        prefetch_rows(w_ptr, tl.minimum(offs_n, N - 1), stride_wn, K, LINES, EPL)
    # the first K tile of the weights into registers before the wait (no kernel writes weights); the rest streams in
    # the loop from L2, prefetched above. The K tiles accumulate in the same order as a plain loop: bit-identical
    offs_k = tl.arange(0, BLOCK_K)
    w = weight_tile_t(w_ptr, offs_n, n_mask, offs_k, K, stride_wn)
    mn_mask = m_mask[:, None] & n_mask[None, :]
    r_at = r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]
    if HAS_RESIDUAL and EARLY_R:  # the caller says r predates the kernel this one may overlap
        r = tl.load(r_at, mask=mn_mask, other=0.0).to(tl.float32)
    wait_for_previous(USE_GDC)
    t_rows = offs_m  # GATHER: the table row of each input row (ids are the forward's inputs, read after the wait)
    if GATHER:
        t_rows = tl.load(ids_ptr + offs_m, mask=m_mask, other=0)
    acc = tl.dot(_any_input_tile(a_ptr, offs_m, m_mask, offs_k, K, stride_am, t_ptr, t_rows, KT, stride_t, GATHER), w,
                 input_precision=DOT_PREC)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = weight_tile_t(w_ptr, offs_n, n_mask, offs_k, K, stride_wn)
        acc += tl.dot(_any_input_tile(a_ptr, offs_m, m_mask, offs_k, K, stride_am, t_ptr, t_rows, KT, stride_t,
                                      GATHER), w, input_precision=DOT_PREC)
    dt = out_ptr.dtype.element_ty
    y = rounded(acc, dt)
    if HAS_RESIDUAL:
        if not EARLY_R:
            r = tl.load(r_at, mask=mn_mask, other=0.0).to(tl.float32)
        y += r
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(dt), mask=mn_mask)


@triton.jit(do_not_specialize=["M"])
def _norm_gate_up_kernel(
    x_ptr, ln_w_ptr, w_ptr, out_ptr, M, N, K, eps, stride_xm, stride_wn, stride_om,
    DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr, LINES: tl.constexpr, EPL: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    dt = out_ptr.dtype.element_ty
    rows = tl.minimum(offs_n, N - 1)  # the gate rows; the up rows are N further on
    w_g, w_u = pair_first_tiles(w_ptr, rows, rows + N, n_mask, K, stride_wn, BLOCK_K, USE_GDC, LINES, EPL)
    wait_for_previous(USE_GDC)
    acc_g, acc_u = pair_dots(x_ptr, ln_w_ptr, stride_xm, offs_m, m_mask, K, eps, w_ptr, rows, rows + N, n_mask,
                             stride_wn, w_g, w_u, dt, True, DOT_PREC, BLOCK_M, BLOCK_K)
    g = rounded(acc_g, dt)
    act = rounded(g / (1.0 + tl.exp(-g)), dt)  # F.silu's output
    out = act * rounded(acc_u, dt)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(dt),
             mask=m_mask[:, None] & n_mask[None, :])


def linear_residual(a: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None, *, early_residual: bool = False,
                    gather: tuple[torch.Tensor, torch.Tensor] | None = None,
                    config: Config | None = None) -> torch.Tensor:
    """r + x @ w^T (or x @ w^T) with x = a, or x = concat(table[ids], a) for gather = (table [Vt, KT], ids [M] int64):
    x [M, K], w [N, K], r [M, N] -> [M, N] (a new tensor: r may be a captured input).
    early_residual: r was written before the kernel launched right before this one (a layer's o_proj / down: their
    residual comes from two or more kernels back), so it is read before the PDL wait, off the critical path; never
    set it when the previous kernel may write r. config: the sweep's candidate (default: kernels/tuning.py's, and
    torch's F.linear for the shapes where tuning found cuBLAS faster)."""
    m, ka = a.shape
    table, ids = gather if gather is not None else (a, a)  # unused pointers get any tensor
    kt = table.shape[1] if gather is not None else 0
    k = kt + ka
    n = w.shape[0]
    assert a.stride(1) == 1 and w.stride(1) == 1 and (r is None or r.stride(1) == 1) and w.shape[1] == k
    assert gather is None or (table.stride(1) == 1 and table.dtype == a.dtype and ids.shape == (m,))
    if config is None:
        one = slice(0, 1)  # a first use tunes on one row: the decode case (the config never depends on M)
        r1 = r[one] if r is not None else None
        config = config_for(
            "linear_residual", n, k, a.device,
            launch=lambda c: linear_residual(a[one], w, r1, gather=(table, ids[one]) if gather else None, config=c),
            torch_launch=None if gather else lambda: torch_linear_residual(a[one], w, r1),
        )
        if gather is None and prefers_torch("linear_residual", n, k, a.device):
            return torch_linear_residual(a, w, r)
    cfg = config
    lines, epl = prefetch_lines(k, w, cfg.prefetch)
    out = torch.empty((m, n), device=a.device, dtype=a.dtype)
    _linear_residual_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, cfg.block_n))](
        a, w, r if r is not None else out, out, table, ids, m, n, k, kt, a.stride(0), w.stride(0),
        r.stride(0) if r is not None else 0, out.stride(0), table.stride(0), HAS_RESIDUAL=r is not None,
        EARLY_R=early_residual, GATHER=gather is not None,
        DOT_PREC=dot_precision(w.dtype), BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        LINES=lines, EPL=epl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(a.device, m),
    )
    return out


def norm_gate_up(x: torch.Tensor, ln_w: torch.Tensor, w: torch.Tensor, eps: float, *,
                 config: Config | None = None) -> torch.Tensor:
    """silu(g) * u with g | u = RMSNorm(x) @ w^T: x [M, H], ln_w [H], w [2I, H] (rows gate | up) -> [M, I].
    config: the sweep's candidate (default: config_for)."""
    m, k = x.shape
    i = w.shape[0] // 2
    assert x.stride(1) == 1 and w.stride(1) == 1
    cfg = config or config_for("norm_gate_up", i, k, x.device,
                               launch=lambda c: norm_gate_up(x[:1], ln_w, w, eps, config=c))
    lines, epl = prefetch_lines(k, w, cfg.prefetch)
    out = torch.empty((m, i), device=x.device, dtype=x.dtype)
    _norm_gate_up_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(i, cfg.block_n))](
        x, ln_w, w, out, m, i, k, eps, x.stride(0), w.stride(0), out.stride(0),
        DOT_PREC=dot_precision(w.dtype), BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        LINES=lines, EPL=epl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device, m),
    )
    return out


def torch_linear_residual(a: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """`linear_residual` in torch (cuBLAS), rounded the same way: the projection's output, then the add. For the shapes
    where tuning found cuBLAS faster (kernels/tuning.prefers_torch)."""
    y = F.linear(a, w)
    return y if r is None else y + r
