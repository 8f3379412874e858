"""Exact speculative sampling of a CHAIN proposal (one child per node) in three Triton kernels, for a batch that samples
with one temperature T > 0 and no top-k / top-p: the same result as `verify_sampling(processed_probs(logits, T))`
(speculative/verify/verifier.py, whose docstring defines accepted / recovered / bonus tokens) without the [R, W, V] softmax and the
~10 [R, V] torch kernels per depth that cost ~1 ms of H200 time per step at batch 8, depth 6.

The vocabulary is split into S chunks of `chunk_v` columns so that both passes over V run in parallel ((row, chunk)
programs, ~200 at batch 8 and V = 49152) instead of one program walking V serially:
- `_node_stats_kernel`, one program per (row, node, chunk) on the nodes the walk can read (node <= D, node < counts):
  the chunk's max m_c and sum of exp(logits / T - m_c) in one online pass, and its sum of the node's draft_probs
  (verify_sampling renormalises q). Readers merge the S partials (m = max m_c, Z = sum Z_c exp(m_c - m)), so that
  p(x) = exp(l_x / T - m) / Z and q(x) = q_x / qsum are scalar reads;
- `_walk` (inlined in both kernels below, D <= 16 scalar loads): a chain's nodes are fixed (node i's child is i+1),
  so every depth's test u * q(x) < p(x) (x = node i+1's token, u = uniforms[r, i], q one-hot for a deterministic
  drafter) runs at once, and the walk stops at the first failure: a rejection, the row's last node or D;
- `_chain_race_kernel`, one program per (row, chunk): one pass over the chunk of the stop node's row writes the
  residual max(0, p - q)'s partial mass and the winners (value, index) of two exponential races argmax(w_v / noise_v):
  on that unnormalised residual and on p itself;
- `_chain_finish_kernel`, one program per row: the residual race if the row was rejected and its residual mass is
  > TINY, else the p race (the bonus after a full acceptance, or verifier.py's fallback for an all-zero residual); ties
  to the lowest index (torch.argmax's). Writes the run; log-probs are log p (the unmodified p) of emitted tokens.

Divisions are `div_rn` in verify_sampling's order, except the residual race, which skips torch's division by the
residual mass (a positive constant: the same argmax up to rounding). p differs from torch's in the last ulps only
(Triton's exp, the chunked sum order, torch's x * (1/T) on CUDA), so a decision differs only on a float tie (u * q(x)
vs p(x), or two race values, within ~1e-6 relative). No host sync and fixed shapes: it runs inside the speculative
step's CUDA graph (rollout/speculative_body.py routes chain, uniform-temperature batches here).
Tests: `python -m pytest tests/kernels/test_kernels_chain_verify.py -q` (CPU interpreter; `-m gpu` at V = 49152).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.tlt.decoding.draft_types import VerifyResult
from worker.tlt.decoding.sampling import exponential_noise

TINY = 1e-30  # speculative/verify/verifier.py's _TINY and pick_with_noise's noise floor
EMPTY_MAX = -1.0e30  # running max before any column (finite: exp(EMPTY_MAX - m) is exactly 0, no NaN)
MAX_BLOCK_V = 2048  # vocabulary columns per step (49152 = 24 steps)
RACE_PROGRAMS = 256  # (row, chunk) programs the default chunk aims at: enough to fill an H200's 132 SMs


@triton.jit
def _node_stats_kernel(
    logits_ptr, q_ptr, counts_ptr, parts_ptr, V, CHUNK, S, stride_lr, stride_ln, stride_qr, stride_qn,
    W: tl.constexpr, D: tl.constexpr, T: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr,
    EMPTY_MAX: tl.constexpr,
):
    r = tl.program_id(0)
    n = tl.program_id(1)
    c = tl.program_id(2)
    needed = (n <= D) & (n < tl.load(counts_ptr + r))
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    row = logits_ptr + r.to(tl.int64) * stride_lr + n * stride_ln
    m_vec = tl.full([BLOCK_V], EMPTY_MAX, dtype=tl.float32)  # per-lane online softmax state
    z_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    q_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(lo, tl.where(needed, hi, lo), BLOCK_V):  # nodes the walk never reads cost one store
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < hi
        s = tl.div_rn(tl.load(row + offs, mask=mask, other=float("-inf")).to(tl.float32), T)
        m_new = tl.maximum(m_vec, s)
        z_vec = z_vec * tl.exp(m_vec - m_new) + tl.exp(s - m_new)
        m_vec = m_new
        if HAS_Q:
            q_vec += tl.load(q_ptr + r.to(tl.int64) * stride_qr + n * stride_qn + offs, mask=mask, other=0.0)
    m = tl.max(m_vec, axis=0)
    z = tl.sum(z_vec * tl.exp(m_vec - m), axis=0)
    out = parts_ptr + ((r * W + n) * S + c) * 3
    tl.store(out, m)
    tl.store(out + 1, z)
    tl.store(out + 2, tl.sum(q_vec, axis=0))


@triton.jit
def _p_of(row, tok, mask, m, z, T: tl.constexpr):
    """p(tok) of a node's logit row (scalars or vectors): softmax(logits / T) from the node's merged (m, Z)."""
    s = tl.div_rn(tl.load(row + tok, mask=mask, other=0.0).to(tl.float32), T)
    return tl.div_rn(tl.exp(s - m), z)


@triton.jit
def _walk(
    logits_ptr, q_ptr, tokens_ptr, counts_ptr, parts_ptr, unif_ptr, r, S,
    stride_lr, stride_ln, stride_qr, stride_qn, stride_tr, stride_ur,
    W: tl.constexpr, D: tl.constexpr, T: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, TINY: tl.constexpr, EMPTY_MAX: tl.constexpr,
):
    """Row r's acceptance walk: (child tokens x [BLOCK_D], p(x) [BLOCK_D], accepted drafts n_acc, rejected, the
    rejected token, and the stop node's merged m, Z, qsum)."""
    r64 = r.to(tl.int64)
    cnt = tl.load(counts_ptr + r)
    d = tl.arange(0, BLOCK_D)
    # merge the S chunk partials of every node the walk can read, in one [BLOCK_D, BLOCK_S] load per statistic
    needed = (d <= D) & (d < cnt)
    c = tl.arange(0, BLOCK_S)
    part = parts_ptr + ((r * W + d[:, None]) * S + c[None, :]) * 3
    ok = needed[:, None] & (c[None, :] < S)
    m_c = tl.load(part, mask=ok, other=EMPTY_MAX)
    m_d = tl.max(m_c, axis=1)
    z_d = tl.sum(tl.load(part + 1, mask=ok, other=0.0) * tl.exp(m_c - m_d[:, None]), axis=1)
    qs_d = tl.maximum(tl.sum(tl.load(part + 2, mask=ok, other=0.0), axis=1), TINY)
    m_d = tl.where(needed, m_d, 0.0)  # unread nodes: finite stats, so the masked-off p(x) stays finite
    z_d = tl.where(needed, z_d, 1.0)
    # every depth's test at once (a chain's nodes are fixed: node d's child is d + 1), then the first failure
    has_child = (d < D) & (d + 1 < cnt)
    x = tl.load(tokens_ptr + r64 * stride_tr + d + 1, mask=has_child, other=0)  # [BLOCK_D] child tokens
    p_x = _p_of(logits_ptr + r64 * stride_lr + d * stride_ln, x, has_child, m_d, z_d, T)
    if HAS_Q:
        q_x = tl.div_rn(tl.load(q_ptr + r64 * stride_qr + d * stride_qn + x, mask=has_child, other=0.0), qs_d)
    else:
        q_x = tl.full([BLOCK_D], 1.0, tl.float32)
    u = tl.load(unif_ptr + r64 * stride_ur + d, mask=has_child, other=1.0)
    acc = has_child & (u * q_x < p_x)
    n_acc = tl.min(tl.where(acc, D, d), axis=0)  # accepted drafts = index of the first failure (D: none failed)
    rejected = (n_acc < D) & (n_acc + 1 < cnt)  # stopped by a rejection, not by a leaf or by D
    at = d == n_acc
    x_rej = tl.sum(tl.where(at, x, 0), axis=0)
    m = tl.sum(tl.where(at, m_d, 0.0), axis=0)
    z = tl.sum(tl.where(at, z_d, 0.0), axis=0)
    q_sum = tl.sum(tl.where(at, qs_d, 0.0), axis=0)
    return x, p_x, n_acc, rejected, x_rej, m, z, q_sum


@triton.jit
def _race_weights(row, q_row, offs, mask, m, z, q_sum, x_rej, T: tl.constexpr, HAS_Q: tl.constexpr):
    """p and q over columns offs of the stop node, as verify_sampling has them (q renormalised, or one-hot x)."""
    p = tl.div_rn(tl.exp(tl.div_rn(tl.load(row + offs, mask=mask, other=float("-inf")).to(tl.float32), T) - m), z)
    if HAS_Q:
        q = tl.div_rn(tl.load(q_row + offs, mask=mask, other=0.0), q_sum)
    else:
        q = tl.where(offs == x_rej, 1.0, 0.0)
    return p, q


@triton.jit
def _race_step(val, v0, best, best_i):
    """Fold one tile's race values into the running winner; strict >: the earliest tile keeps a tie."""
    blk = tl.max(val, axis=0)
    blk_i = tl.argmax(val, axis=0, tie_break_left=True) + v0
    take = blk > best
    return tl.where(take, blk, best), tl.where(take, blk_i, best_i)


@triton.jit
def _chain_race_kernel(
    logits_ptr, q_ptr, tokens_ptr, counts_ptr, parts_ptr, unif_ptr, noise_ptr, race_ptr, race_i_ptr,
    V, CHUNK, S, stride_lr, stride_ln, stride_qr, stride_qn, stride_tr, stride_ur, stride_nr,
    W: tl.constexpr, D: tl.constexpr, T: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, TINY: tl.constexpr, EMPTY_MAX: tl.constexpr,
):
    r = tl.program_id(0)
    c = tl.program_id(1)
    r64 = r.to(tl.int64)
    _, _, n_acc, _, x_rej, m, z, q_sum = _walk(
        logits_ptr, q_ptr, tokens_ptr, counts_ptr, parts_ptr, unif_ptr, r, S, stride_lr, stride_ln, stride_qr,
        stride_qn, stride_tr, stride_ur, W, D, T, HAS_Q, BLOCK_D, BLOCK_S, TINY, EMPTY_MAX)
    row = logits_ptr + r64 * stride_lr + n_acc * stride_ln
    q_row = q_ptr + r64 * stride_qr + n_acc * stride_qn
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    res_sum = tl.full([], 0.0, tl.float32)
    best_r = tl.full([], -1.0, tl.float32)  # below every weight / noise >= 0: an all-zero chunk picks its first column
    best_ri = tl.full([], 0, tl.int32)
    best_p = tl.full([], -1.0, tl.float32)
    best_pi = tl.full([], 0, tl.int32)
    for v0 in range(lo, hi, BLOCK_V):  # both races in one pass: only the finish knows which one the row needs
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < hi
        p, q = _race_weights(row, q_row, offs, mask, m, z, q_sum, x_rej, T, HAS_Q)
        res = tl.maximum(p - q, 0.0)  # 0 off the chunk: p is 0 there
        res_sum += tl.sum(res, axis=0)
        e = tl.maximum(tl.load(noise_ptr + r64 * stride_nr + offs, mask=mask, other=1.0), TINY)
        best_r, best_ri = _race_step(tl.where(mask, tl.div_rn(res, e), -1.0), v0, best_r, best_ri)
        best_p, best_pi = _race_step(tl.where(mask, tl.div_rn(p, e), -1.0), v0, best_p, best_pi)
    out = race_ptr + (r * S + c) * 3
    tl.store(out, res_sum)
    tl.store(out + 1, best_r)
    tl.store(out + 2, best_p)
    tl.store(race_i_ptr + (r * S + c) * 2, best_ri)
    tl.store(race_i_ptr + (r * S + c) * 2 + 1, best_pi)


@triton.jit
def _chain_finish_kernel(
    logits_ptr, q_ptr, tokens_ptr, counts_ptr, parts_ptr, unif_ptr, race_ptr, race_i_ptr,
    out_tok_ptr, out_lp_ptr, out_acc_ptr, out_n_ptr,
    V, S, stride_lr, stride_ln, stride_qr, stride_qn, stride_tr, stride_ur,
    W: tl.constexpr, D: tl.constexpr, T: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, TINY: tl.constexpr, EMPTY_MAX: tl.constexpr,
):
    r = tl.program_id(0)
    x, p_x, n_acc, rejected, _, m, z, _ = _walk(
        logits_ptr, q_ptr, tokens_ptr, counts_ptr, parts_ptr, unif_ptr, r, S, stride_lr, stride_ln, stride_qr,
        stride_qn, stride_tr, stride_ur, W, D, T, HAS_Q, BLOCK_D, BLOCK_S, TINY, EMPTY_MAX)
    # the last token: residual race of the rejected node, or p's race (bonus; an all-zero residual, as verifier.py)
    c = tl.arange(0, BLOCK_S)
    ok = c < S
    part = race_ptr + (r * S + c) * 3
    use_res = rejected & (tl.sum(tl.load(part, mask=ok, other=0.0), axis=0) > TINY)
    val = tl.load(part + tl.where(use_res, 1, 2), mask=ok, other=-2.0)
    idx = tl.load(race_i_ptr + (r * S + c) * 2 + tl.where(use_res, 0, 1), mask=ok, other=0)
    best = tl.max(val, axis=0)
    best_i = tl.min(tl.where(ok & (val == best), idx, V), axis=0)  # a tie across chunks: the lowest index
    row = logits_ptr + r.to(tl.int64) * stride_lr + n_acc * stride_ln
    lp_last = tl.log(_p_of(row, best_i, True, m, z, T))
    # the run: accepted drafts (nodes 1..n_acc), the drawn token at column n_acc, padding after it
    j = tl.arange(0, BLOCK_D)
    cols = j < D + 1
    acc = j < n_acc
    out = r * (D + 1) + j
    tl.store(out_tok_ptr + out, tl.where(acc, x, tl.where(j == n_acc, best_i.to(tl.int64), 0)), mask=cols)
    tl.store(out_lp_ptr + out, tl.where(acc, tl.log(tl.where(acc, p_x, 1.0)), tl.where(j == n_acc, lp_last, 0.0)),
             mask=cols)
    tl.store(out_acc_ptr + out, tl.where(acc, j + 1, -1), mask=cols)
    tl.store(out_n_ptr + r, (n_acc + 1).to(tl.int64))


def default_chunk(rows: int, vocab: int, block_v: int) -> int:
    """Columns per chunk: whole tiles, as few per chunk as keep rows * chunks near RACE_PROGRAMS (one tile at
    batch 8 and V = 49152: 24 chunks, 192 race programs)."""
    tiles = triton.cdiv(vocab, block_v)
    return max(1, tiles * rows // RACE_PROGRAMS) * block_v


def chain_verify(
    logits: torch.Tensor,  # [R, W, V] target logits at the chain's nodes (any float dtype; last dim contiguous)
    tokens: torch.Tensor,  # [R, W] int64 root then drafted tokens
    counts: torch.Tensor,  # [R] int64 valid nodes per row (root included); nodes past it are padding
    draft_probs: torch.Tensor | None,  # [R, W, V] fp32 q of node i's child (None: deterministic drafter, q one-hot)
    depth: int,  # static bound D on accepted drafts (<= W - 1)
    temperature: float,  # T > 0
    *,
    uniforms: torch.Tensor | None = None,  # [R, >= D] U(0, 1), column i for node i+1 (None: drawn from generator)
    noise: torch.Tensor | None = None,  # [R, V] fp32 Exp(1) for the last token (None: drawn from generator)
    generator: torch.Generator | None = None,
    block_v: int | None = None,  # vocabulary tile (tests force several tiles on a tiny V)
    chunk_v: int | None = None,  # columns per parallel chunk (None: default_chunk; tests force several on a tiny V)
) -> VerifyResult:
    """verify_sampling(chain proposal, processed_probs(logits, T), max_depth=D, max_children=1) in three kernels
    (module docstring). Missing randomness is drawn as verify_sampling draws it (uniforms, then noise), so an eager
    caller consumes the generator exactly as the torch path does."""
    if temperature <= 0.0:
        raise ValueError(f"chain_verify samples: temperature must be > 0, got {temperature}")
    r, w, v = logits.shape
    if not 0 <= depth < w:
        raise ValueError(f"depth {depth} must be in [0, W - 1 = {w - 1}]")
    dev = logits.device
    if uniforms is None:
        uniforms = torch.rand(r, max(depth, 1), device=dev, generator=generator)
    if noise is None:
        noise = exponential_noise(logits[:, 0], generator)
    if logits.stride(2) != 1:
        logits = logits.contiguous()
    q = draft_probs
    if q is not None and (q.dtype != torch.float32 or q.stride(2) != 1):
        q = q.float().contiguous()
    noise = noise.float().contiguous()
    uniforms = uniforms.float().contiguous()
    tokens = tokens.contiguous()
    counts = counts.contiguous()
    blk = block_v or min(MAX_BLOCK_V, triton.next_power_of_2(v))
    chunk = chunk_v or default_chunk(r, v, blk)
    s = triton.cdiv(v, chunk)  # every chunk holds at least one column
    q_arg = q if q is not None else logits  # never read without HAS_Q
    consts = dict(W=w, D=depth, T=float(temperature), HAS_Q=q is not None)
    walk = dict(BLOCK_D=triton.next_power_of_2(depth + 1), BLOCK_S=triton.next_power_of_2(s), TINY=TINY,
                EMPTY_MAX=EMPTY_MAX)
    parts = torch.empty(r, w, s, 3, dtype=torch.float32, device=dev)  # (m, Z, qsum) per node and chunk
    _node_stats_kernel[(r, w, s)](
        logits, q_arg, counts, parts, v, chunk, s, logits.stride(0), logits.stride(1), q_arg.stride(0),
        q_arg.stride(1), **consts, BLOCK_V=blk, EMPTY_MAX=EMPTY_MAX, num_warps=4)
    race = torch.empty(r, s, 3, dtype=torch.float32, device=dev)  # (residual mass, residual best, p best) per chunk
    race_i = torch.empty(r, s, 2, dtype=torch.int32, device=dev)  # (residual winner, p winner) per chunk
    strides = (logits.stride(0), logits.stride(1), q_arg.stride(0), q_arg.stride(1), tokens.stride(0),
               uniforms.stride(0))
    _chain_race_kernel[(r, s)](
        logits, q_arg, tokens, counts, parts, uniforms, noise, race, race_i, v, chunk, s, *strides, noise.stride(0),
        **consts, **walk, BLOCK_V=blk, num_warps=4)
    out_tok = torch.empty(r, depth + 1, dtype=torch.int64, device=dev)
    out_lp = torch.empty(r, depth + 1, dtype=torch.float32, device=dev)
    out_acc = torch.empty(r, depth + 1, dtype=torch.int64, device=dev)
    out_n = torch.empty(r, dtype=torch.int64, device=dev)
    _chain_finish_kernel[(r,)](
        logits, q_arg, tokens, counts, parts, uniforms, race, race_i, out_tok, out_lp, out_acc, out_n, v, s, *strides,
        **consts, **walk, num_warps=2)
    return VerifyResult(tokens=out_tok, num_emitted=out_n, accepted_nodes=out_acc, logprobs=out_lp)
