"""The speculative step's commit and statistics in one Triton kernel: from the verifier's emitted runs to the
committed row state and the step's packed result (rollout/speculative_body.py's layout), what RowState.commit_no_sync of
runs of width K plus the body's per-position counts and torch.cat leave behind. In torch that tail is ~60 kernels
of a few rows each; replayed from the verify graph on an H200 it cost ~0.15 ms per step, a quarter of a plain
decode step.

One program holds every row (R <= BLOCK_R, a verify graph's batch bucket): per row, the run is cut after its first
EOS and at max_new_tokens, done rows and rows past the batch (r >= n_rows) emit nothing and write into the scratch
columns cap.., lens / n_gen / last / done advance; then, over the rows that were active before the commit, how many
accepted (emitted - 1 >= k) and drafted (row depth >= k) a k-th token for k = 1..D, the active rows and their
verify nodes. Packed (int64): [n (R) | done (R) | accepted (D) | drafted (D) | active, nodes | tokens (R x K)].
Tests: `python -m pytest tests/kernels/test_kernels_spec_commit.py -q` (CPU interpreter; `-m gpu` compiled).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.tlt.decoding.row_state import RowState


@triton.jit
def _spec_commit_kernel(
    tok_ptr, lp_ptr, emit_ptr, counts_ptr, depth_ptr, n_rows_ptr,
    done_ptr, max_new_ptr, n_gen_ptr, eos_ptr, out_tok_ptr, out_lp_ptr, last_ptr, lens_ptr, packed_ptr,
    R, K, D, E, cap, stride_tok, stride_lp, stride_eos, stride_out,
    CHAIN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    r = tl.arange(0, BLOCK_R)
    k = tl.arange(0, BLOCK_K)
    rows = r < R
    cell = rows[:, None] & (k[None, :] < K)
    in_batch = r < tl.load(n_rows_ptr)
    toks = tl.load(tok_ptr + r[:, None] * stride_tok + k[None, :], mask=cell, other=0)
    lps = tl.load(lp_ptr + r[:, None] * stride_lp + k[None, :], mask=cell, other=0.0).to(tl.float32)
    emitted = tl.load(emit_ptr + r, mask=rows, other=0)
    n_emit = tl.where(in_batch, emitted, 0)
    done_before = tl.load(done_ptr + r, mask=rows, other=1) != 0
    ev = tl.arange(0, BLOCK_E)
    stops = tl.load(eos_ptr + r[:, None] * stride_eos + ev[None, :], mask=rows[:, None] & (ev[None, :] < E), other=-1)
    is_eos = toks < 0  # all False, [BLOCK_R, BLOCK_K]
    for e in tl.static_range(BLOCK_E):  # stop token e of every row
        is_eos = is_eos | (toks == tl.sum(tl.where(ev[None, :] == e, stops, 0), axis=1)[:, None])
    is_eos = is_eos & (k[None, :] < n_emit[:, None])
    first_eos = tl.min(tl.where(is_eos, k[None, :], K), axis=1)
    n_gen = tl.load(n_gen_ptr + r, mask=rows, other=0)
    remaining = tl.load(max_new_ptr + r, mask=rows, other=0) - n_gen
    n = tl.minimum(tl.minimum(n_emit, first_eos + 1), remaining)
    n = tl.where(done_before, 0, tl.maximum(n, 0))
    finished = (~done_before) & ((first_eos < n) | (n >= remaining))
    col = tl.where(k[None, :] < n[:, None], n_gen[:, None] + k[None, :], cap + k[None, :])
    tl.store(out_tok_ptr + r[:, None] * stride_out + col, toks, mask=cell)
    tl.store(out_lp_ptr + r[:, None] * stride_out + col, lps, mask=cell)
    new_last = tl.sum(tl.where(k[None, :] == n[:, None] - 1, toks, 0), axis=1)
    tl.store(last_ptr + r, tl.where(n > 0, new_last, tl.load(last_ptr + r, mask=rows, other=0)), mask=rows)
    tl.store(lens_ptr + r, tl.load(lens_ptr + r, mask=rows, other=0) + n, mask=rows)
    tl.store(n_gen_ptr + r, n_gen + n, mask=rows)
    done_after = done_before | finished
    tl.store(done_ptr + r, done_after.to(tl.uint8), mask=rows)
    # the step's counts, over the rows active before the commit
    active = (~done_before) & in_batch & rows
    counts = tl.load(counts_ptr + r, mask=rows, other=1)
    if CHAIN:
        depth = counts - 1
    else:
        depth = tl.load(depth_ptr + r, mask=rows, other=0)
    ks = tl.arange(0, BLOCK_D) + 1
    on = active[:, None] & (ks[None, :] <= D)
    acc = tl.sum((on & ((emitted - 1)[:, None] >= ks[None, :])).to(tl.int64), axis=0)
    drafted = tl.sum((on & (depth[:, None] >= ks[None, :])).to(tl.int64), axis=0)
    tl.store(packed_ptr + r, n.to(tl.int64), mask=rows)
    tl.store(packed_ptr + R + r, done_after.to(tl.int64), mask=rows)
    tl.store(packed_ptr + 2 * R + ks - 1, acc, mask=ks <= D)
    tl.store(packed_ptr + 2 * R + D + ks - 1, drafted, mask=ks <= D)
    tl.store(packed_ptr + 2 * R + 2 * D, tl.sum(active.to(tl.int64), axis=0))
    tl.store(packed_ptr + 2 * R + 2 * D + 1, tl.sum(tl.where(active, counts, 0).to(tl.int64), axis=0))
    tl.store(packed_ptr + 2 * R + 2 * D + 2 + r[:, None] * K + k[None, :], toks.to(tl.int64), mask=cell)


def spec_commit(
    tokens: torch.Tensor,  # [R, K] int64 emitted run per row (left-aligned; K = depth bound + 1)
    logprobs: torch.Tensor,  # [R, K] their target log-probs
    emitted: torch.Tensor,  # [R] int64 run length before EOS / budget cuts
    counts: torch.Tensor,  # [R] int64 verify nodes per row
    row_depth: torch.Tensor | None,  # [R] int64 deepest drafted node per row (None: a chain's, counts - 1)
    n_rows: torch.Tensor,  # [1] int64 rows of the batch (the rest are a graph's padding)
    rows: RowState,  # rows 0..R-1 commit
    depth: int,  # D: per-position counts 1..D
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (packed [2R + 2D + 2 + R*K] int64, n [R] int64 tokens emitted after the cuts: a view of packed)."""
    r, k = tokens.shape
    d = max(depth, 1)
    packed = torch.empty(2 * r + 2 * d + 2 + r * k, dtype=torch.int64, device=tokens.device)
    e = rows.eos.shape[1]
    _spec_commit_kernel[(1,)](
        tokens, logprobs, emitted, counts, row_depth if row_depth is not None else counts, n_rows,
        rows.done.view(torch.uint8), rows.max_new, rows.n_gen, rows.eos, rows.out_tok, rows.out_lp, rows.last,
        rows.lens, packed, r, k, d, e, rows.cap, tokens.stride(0), logprobs.stride(0), rows.eos.stride(0),
        rows.out_tok.stride(0), CHAIN=row_depth is None, BLOCK_R=triton.next_power_of_2(r),
        BLOCK_K=triton.next_power_of_2(k), BLOCK_D=triton.next_power_of_2(d), BLOCK_E=triton.next_power_of_2(e),
    )
    return packed, packed[:r]
