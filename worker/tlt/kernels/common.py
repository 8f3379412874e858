"""Pieces shared by the fused decode kernels: the RMSNorm prologue (sum of squares over a row, then the normalised
tile in the weight dtype, rounded as HF's RMSNorm rounds), the dtype round trip that mimics a torch op's output
rounding, and the launch configs (tile sizes, warps, pipeline stages).

A kernel's config depends on the weight shape (N, K) only, never on the number of tokens M, so that every row's
result is bit-identical whatever the batch (plain decode and speculative verify then agree exactly; the K tile
fixes the order of the fp32 accumulation). kernels/tuning.py picks a config per (GPU, weight shape); `default_config`
is its rule for shapes not tuned. The switches (PDL, prefetch) come from kernels/settings.py's KernelConfig.
Tests: `python -m pytest tests/kernels -q`.

Programmatic dependent launch (PDL, Hopper and later; `pdl_args`): at one decode token every kernel here is
latency-bound, and inside a CUDA graph each dependent launch still waits for the previous kernel to drain before its
programs are even scheduled. With PDL a kernel's programs start while the previous kernel runs and wait at
`gdc_wait` (all of the previous grid done, its writes visible) before they touch anything it may write or read;
right after, `gdc_launch_dependents` lets the next kernel be scheduled in turn. Kernels launched without the
attribute (torch's) keep plain stream order, so mixing both stays correct.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker.tlt.kernels.settings import current

BLOCK_M = 16  # tl.dot needs M tiles >= 16; decode batches are padded up to it by masks


@dataclass(frozen=True)
class Config:
    block_n: int  # output columns per program (attention: cache columns per step; qkv_rope: output rows of a head
    #   per program, a power of 2 dividing head_dim; 0 or > head_dim: the whole head; with q/k norm always the head)
    block_k: int  # reduction columns per step (attention: ignored)
    num_warps: int = 4
    num_stages: int = 2  # software-pipelined loads in flight (1: none)
    split: int = 0  # attention only: cache columns per split program (flash-decoding); 0: one program per row
    prefetch: bool = True  # GEMMs: prefetch the program's weight rows into L2 before the PDL wait (see below)


# Weight matrices above this many bytes are not prefetched by the default rule: every program prefetches its whole
# rows up front, which pays while the matrix fits the L2 (60 MB on an H200) and thrashes it beyond: on an H200 the
# 272 MB gate|up of Qwen2.5-7B took 107.6 us with prefetch and 84.9 us without (one decode token), its 136 MB down
# 49.6 vs 37.1 us, while its 26 MB o_proj ran at 2.9 TB/s with prefetch.
PREFETCH_MAX_BYTES = 32 << 20


def default_config(kernel: str, n: int, k: int) -> Config:
    """The rule for shapes the sweep has not seen, aimed at 1-token decode on a GPU of ~132 SMs, where every kernel
    is latency-bound and launches too few programs to fill the SMs: wide K tiles (a decode GEMV waits on its K / BLOCK_K
    sequential steps), narrow N tiles (more programs over the SMs).
    - attention: split the cache columns in chunks of one 64-column block (split = block_n): the shortest serial
      walk per program, and a 512-column SmolLM2 row (3 KV heads) becomes 24 programs instead of 3 (2000 columns: 96);
      the last split to finish merges the chunk partials, one [G, D] fp32 tile per split.
    - qkv_rope: 16 output rows per program (60 programs for SmolLM2's 15 heads of 64 instead of 15); its two
      [BLOCK_K, 16] weight tiles per step (the rows and their rotation) stay small, so BLOCK_K can be 256."""
    if kernel == "attention":
        return Config(block_n=64, block_k=k, num_warps=4, num_stages=2, split=64)
    bk = max(16, min(256, triton.next_power_of_2(k)))
    fits = (2 if kernel == "norm_gate_up" else 1) * n * k * 2 <= PREFETCH_MAX_BYTES  # bf16 weight bytes
    if kernel == "qkv_rope":
        return Config(block_n=16, block_k=bk, num_warps=4, num_stages=2, prefetch=fits)
    bn = 16 if n <= 1024 else 32
    return Config(block_n=bn, block_k=bk, num_warps=4, num_stages=2, prefetch=fits)


_PDL: dict[torch.device, bool] = {}


def pdl_args(device: torch.device, m: int) -> dict[str, bool]:
    """Launch kwargs of a fused kernel for m tokens on `device`: USE_GDC, and launch_pdl where PDL is on (sm_90+,
    a Triton that has it, KernelConfig.pdl, m <= KernelConfig.pdl_max_tokens)."""
    cfg = current()
    on = cfg.pdl and m <= cfg.pdl_max_tokens and _pdl_supported(device)
    return {"USE_GDC": True, "launch_pdl": True} if on else {"USE_GDC": False}


def _pdl_supported(device: torch.device) -> bool:
    on = _PDL.get(device)
    if on is None:
        on = False
        if device.type == "cuda":
            try:
                from triton.backends.nvidia.compiler import CUDAOptions

                on = "launch_pdl" in CUDAOptions.__dataclass_fields__
            except ImportError:
                on = False
            on = on and torch.cuda.get_device_capability(device)[0] >= 9
        _PDL[device] = on
    return on


@triton.jit
def prefetch(ptrs):
    """Start pulling the 128-byte lines at `ptrs` (a pointer tensor of any shape) into L2 and return without
    waiting: issued before `wait_for_previous`, the reads overlap the previous kernel. A prefetch cannot change what
    a later load returns, so its addresses may come from data the previous kernel is still writing."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(w_ptr, rows, stride_wn, K, LINES: tl.constexpr, EPL: tl.constexpr):
    """`prefetch` weight rows `rows` [R] of K elements, line by line (EPL elements per line, LINES >= K / EPL a
    power of 2; extra lines repeat the last). Weights are never written by the kernels before: only their reads
    move ahead. LINES 0: nothing (KernelConfig.prefetch off)."""
    if LINES > 0:
        cols = tl.minimum(tl.arange(0, LINES) * EPL, K - 1)
        prefetch(w_ptr + rows[:, None] * stride_wn + cols[None, :])


def prefetch_lines(k: int, w: torch.Tensor, on: bool = True) -> tuple[int, int]:
    """(LINES, EPL) for prefetching rows of k elements of w's dtype (weight rows, cache columns): EPL elements per
    128-byte line, LINES a power of 2 >= k / EPL (0 when `on` is False (the launch config's choice) or with
    KernelConfig.prefetch off)."""
    epl = max(1, 128 // w.element_size())
    if not (on and current().prefetch):
        return 0, epl
    return triton.next_power_of_2(triton.cdiv(k, epl)), epl


@triton.jit
def kv_columns(bt_ptr, row, stride_bt, cols, ok, PAGE: tl.constexpr, stride_cp, stride_ct):
    """int64 offsets of cache columns `cols` of cache row(s) `row` into a layer's pages [n_pages, Hkv, PAGE, D]
    (head 0): column c at page block_table[row, c // PAGE], offset c % PAGE (decoding/kv_cache.py). Entries where
    `ok` is False read page 0 (the scratch page): in range, never attended. PAGE 0: the row layout, whose table is
    the identity (page = row, offset = column), addressed directly: the same code as before pages existed."""
    if PAGE == 0:
        return row.to(tl.int64) * stride_cp + cols * stride_ct
    page = tl.load(bt_ptr + row.to(tl.int64) * stride_bt + cols // PAGE, mask=ok, other=0)
    return page.to(tl.int64) * stride_cp + (cols % PAGE) * stride_ct


_IDENTITY: dict[tuple[torch.device, int], torch.Tensor] = {}  # a pointer for PAGE 0 launches (never read)


def block_table(table: torch.Tensor | None, ck: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the block table a kernel reads, its PAGE): `table` [slots, pages_per_row] int32 with the pages' size, or for
    the row layout (table None, or one page per row: decoding/kv_cache.py's identity) PAGE 0, direct addressing."""
    if table is not None and table.shape[1] > 1:
        assert table.dtype == torch.int32 and table.stride(1) == 1
        return table, int(ck.shape[2])
    key = (ck.device, int(ck.shape[0]))
    ident = _IDENTITY.get(key)
    if ident is None:
        ident = _IDENTITY[key] = torch.arange(key[1], dtype=torch.int32, device=ck.device)[:, None]
    return ident, 0


@triton.jit
def wait_for_previous(USE_GDC: tl.constexpr):
    """PDL: block until the previous kernel in the stream has finished and its writes are visible, then let the
    next kernel's programs be scheduled (module docstring). Call before the first load of anything a previous
    kernel wrote and before the first store. A no-op without PDL."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


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
def weight_tile_t(w_ptr, rows, row_mask, offs_k, K, stride_wn):
    """W[rows, offs_k]^T as a [BK, BN] tile of a row-major weight (zeros past K and outside `row_mask`)."""
    return tl.load(w_ptr + rows[None, :] * stride_wn + offs_k[:, None], mask=(offs_k[:, None] < K) & row_mask[None, :],
                   other=0.0)


@triton.jit
def normed_tile(x_ptr, stride_xm, offs_m, m_mask, offs_k, K, rstd, w_ptr, dt: tl.constexpr):
    """RMSNorm(x)[offs_m, offs_k] in dtype dt as HF computes it: rms_norm rounded to dt, then times the weight."""
    k_mask = offs_k < K
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    return (rounded(x * rstd[:, None], dt) * w[None, :]).to(dt)


@triton.jit
def input_tile(x_ptr, ln_w_ptr, stride_xm, offs_m, m_mask, offs_k, K, rstd, dt: tl.constexpr, HAS_NORM: tl.constexpr):
    """A GEMM's input tile [BM, BK] in dtype dt: RMSNorm(x) (rounded as HF; rstd from `row_rstd`), or x raw."""
    if HAS_NORM:
        return normed_tile(x_ptr, stride_xm, offs_m, m_mask, offs_k, K, rstd, ln_w_ptr, dt)
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K),
                   other=0.0).to(dt)


@triton.jit
def pair_first_tiles(w_ptr, rows_a, rows_b, row_mask, K, stride_wn, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
                     LINES: tl.constexpr, EPL: tl.constexpr):
    """Before the PDL wait of a kernel that multiplies one input by two sets of weight rows (gate and up, a RoPE pair):
    prefetch rows_a and rows_b (in range) into L2 and load their first K tiles W[rows, :BLOCK_K]^T into registers
    (no kernel writes weights; the rest streams in `pair_dots`'s loop from L2)."""
    if USE_GDC:
        prefetch_rows(w_ptr, rows_a, stride_wn, K, LINES, EPL)
        prefetch_rows(w_ptr, rows_b, stride_wn, K, LINES, EPL)
    offs_k = tl.arange(0, BLOCK_K)
    return (weight_tile_t(w_ptr, rows_a, row_mask, offs_k, K, stride_wn),
            weight_tile_t(w_ptr, rows_b, row_mask, offs_k, K, stride_wn))


@triton.jit
def pair_dots(x_ptr, ln_w_ptr, stride_xm, offs_m, m_mask, K, eps, w_ptr, rows_a, rows_b, row_mask, stride_wn, w_a, w_b,
              dt: tl.constexpr, HAS_NORM: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """After the PDL wait: (x' @ W[rows_a]^T, x' @ W[rows_b]^T) in fp32, [BM, R] each, x' = `input_tile` of rows
    offs_m, from the first K tiles w_a, w_b of `pair_first_tiles`. The K tiles accumulate in a plain loop's order:
    bit-identical to one GEMM over all the rows."""
    if HAS_NORM:
        rstd = row_rstd(x_ptr, stride_xm, offs_m, m_mask, K, eps, BLOCK_M, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    xt = input_tile(x_ptr, ln_w_ptr, stride_xm, offs_m, m_mask, offs_k, K, rstd if HAS_NORM else 0.0, dt, HAS_NORM)
    acc_a = tl.dot(xt, w_a, input_precision=DOT_PREC)
    acc_b = tl.dot(xt, w_b, input_precision=DOT_PREC)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = input_tile(x_ptr, ln_w_ptr, stride_xm, offs_m, m_mask, offs_k, K, rstd if HAS_NORM else 0.0, dt, HAS_NORM)
        w_a = weight_tile_t(w_ptr, rows_a, row_mask, offs_k, K, stride_wn)
        w_b = weight_tile_t(w_ptr, rows_b, row_mask, offs_k, K, stride_wn)
        acc_a += tl.dot(xt, w_a, input_precision=DOT_PREC)
        acc_b += tl.dot(xt, w_b, input_precision=DOT_PREC)
    return acc_a, acc_b
