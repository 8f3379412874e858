"""Exact speculative sampling of a CHAIN proposal (one child per node) in two Triton kernels, for a batch that samples
with one temperature T > 0 and no top-k / top-p: the same result as `verify_sampling(processed_probs(logits, T))`
(spec/verify.py, whose docstring defines accepted / recovered / bonus tokens) without the [R, W, V] softmax and the
~10 [R, V] torch kernels per depth that cost ~1 ms of H200 time per step at batch 8, depth 6.

- `_node_stats_kernel`, one program per (row, node) on the nodes the walk can read (node <= D, node < counts): the
  max m and the sum of exp(logits / T - m) over V in one online pass, and the sum of the node's draft_probs row
  (verify_sampling renormalises q), so that p(x) = exp(l_x / T - m) / Z and q(x) = q_x / qsum are scalar reads;
- `_chain_walk_kernel`, one program per row: a chain's nodes are fixed (node i's child is i+1), so every depth's
  test u * q(x) < p(x) (x = node i+1's token, u = uniforms[r, i], q one-hot for a deterministic drafter) runs at
  once, and the walk stops at the first failure: a rejection, the row's last node or D. Then one pass over V draws
  the last token by the exponential race argmax(w_v / noise[r, v]): w is the residual norm(max(0, p - q)) of the
  rejected node (p itself where that is all zero; a pass before sums it) or, after a full acceptance, the bonus row
  p of the last accepted node. Log-probs are log p (the unmodified p) of the emitted tokens.

Divisions are `div_rn` in verify_sampling's order; p differs from torch's in the last ulps only (Triton's exp, the
sum order, torch's x * (1/T) on CUDA), so a decision differs only on a float tie (u * q(x) vs p(x), or two race
values, within ~1e-6 relative). No host sync and fixed shapes: it runs inside the speculative step's CUDA graph
(rollout/spec_body.py routes chain, uniform-temperature batches here).
Tests: `python -m pytest tests/kernels/test_kernels_chain_verify.py -q` (CPU interpreter; `-m gpu` at V = 49152).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.tlt.spec.sampling import exponential_noise
from worker.tlt.spec.types import VerifyResult

TINY = 1e-30  # verify.py's _TINY and pick_with_noise's noise floor
EMPTY_MAX = -1.0e30  # running max before any column (finite: exp(EMPTY_MAX - m) is exactly 0, no NaN)
MAX_BLOCK_V = 2048  # vocabulary columns per step (49152 = 24 steps)


@triton.jit
def _node_stats_kernel(
    logits_ptr, q_ptr, counts_ptr, stats_ptr, V, stride_lr, stride_ln, stride_qr, stride_qn,
    W: tl.constexpr, D: tl.constexpr, T: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr,
    EMPTY_MAX: tl.constexpr,
):
    r = tl.program_id(0)
    n = tl.program_id(1)
    needed = (n <= D) & (n < tl.load(counts_ptr + r))
    n_cols = tl.where(needed, V, 0)  # nodes the walk never reads cost one store
    row = logits_ptr + r.to(tl.int64) * stride_lr + n * stride_ln
    m_vec = tl.full([BLOCK_V], EMPTY_MAX, dtype=tl.float32)  # per-lane online softmax state
    z_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    q_vec = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, n_cols, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        s = tl.div_rn(tl.load(row + offs, mask=mask, other=float("-inf")).to(tl.float32), T)
        m_new = tl.maximum(m_vec, s)
        z_vec = z_vec * tl.exp(m_vec - m_new) + tl.exp(s - m_new)
        m_vec = m_new
        if HAS_Q:
            q_vec += tl.load(q_ptr + r.to(tl.int64) * stride_qr + n * stride_qn + offs, mask=mask, other=0.0)
    m = tl.max(m_vec, axis=0)
    z = tl.sum(z_vec * tl.exp(m_vec - m), axis=0)
    m = tl.where(needed, m, 0.0)  # unread nodes: finite stats, so the walk's masked-off p(x) stays finite
    z = tl.where(needed, z, 1.0)
    out = stats_ptr + (r * W + n) * 3
    tl.store(out, m)
    tl.store(out + 1, z)
    tl.store(out + 2, tl.sum(q_vec, axis=0))


@triton.jit
def _p_of(logits_ptr, stats_ptr, r, node, tok, stride_lr, stride_ln, mask, W: tl.constexpr, T: tl.constexpr):
    """p(tok) at `node` of row r (scalars or vectors): softmax(logits / T) from the node's (m, Z)."""
    st = stats_ptr + (r * W + node) * 3
    s = tl.div_rn(tl.load(logits_ptr + r.to(tl.int64) * stride_lr + node * stride_ln + tok, mask=mask,
                          other=0.0).to(tl.float32), T)
    return tl.div_rn(tl.exp(s - tl.load(st, mask=mask, other=0.0)), tl.load(st + 1, mask=mask, other=1.0))


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
def _chain_walk_kernel(
    logits_ptr, q_ptr, tokens_ptr, counts_ptr, stats_ptr, unif_ptr, noise_ptr,
    out_tok_ptr, out_lp_ptr, out_acc_ptr, out_n_ptr,
    V, stride_lr, stride_ln, stride_qr, stride_qn, stride_tr, stride_ur, stride_nr,
    W: tl.constexpr, D: tl.constexpr, T: tl.constexpr, HAS_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr, TINY: tl.constexpr,
):
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    cnt = tl.load(counts_ptr + r)
    # every depth's test at once (a chain's nodes are fixed: node d's child is d + 1), then the first failure
    d = tl.arange(0, BLOCK_D)
    has_child = (d < D) & (d + 1 < cnt)
    x = tl.load(tokens_ptr + r64 * stride_tr + d + 1, mask=has_child, other=0)  # [BLOCK_D] child tokens
    p_x = _p_of(logits_ptr, stats_ptr, r, d, x, stride_lr, stride_ln, has_child, W, T)
    if HAS_Q:
        q_sum_d = tl.maximum(tl.load(stats_ptr + (r * W + d) * 3 + 2, mask=has_child, other=1.0), TINY)
        q_x = tl.div_rn(tl.load(q_ptr + r64 * stride_qr + d * stride_qn + x, mask=has_child, other=0.0), q_sum_d)
    else:
        q_x = tl.full([BLOCK_D], 1.0, tl.float32)
    u = tl.load(unif_ptr + r64 * stride_ur + d, mask=has_child, other=1.0)
    ok = has_child & (u * q_x < p_x)
    n_acc = tl.min(tl.where(ok, D, d), axis=0)  # accepted drafts = index of the first failure (D: none failed)
    rejected = (n_acc < D) & (n_acc + 1 < cnt)  # stopped by a rejection, not by a leaf or by D
    x_rej = tl.sum(tl.where(d == n_acc, x, 0), axis=0)
    # the last token: residual of the rejected node or bonus of the last accepted one, from node n_acc's row
    st = stats_ptr + (r * W + n_acc) * 3
    m = tl.load(st)
    z = tl.load(st + 1)
    q_sum = tl.maximum(tl.load(st + 2), TINY)
    row = logits_ptr + r64 * stride_lr + n_acc * stride_ln
    q_row = q_ptr + r64 * stride_qr + n_acc * stride_qn
    res_sum = tl.full([], 0.0, tl.float32)
    for v0 in range(0, tl.where(rejected, V, 0), BLOCK_V):  # the residual's mass (bonus rows skip this pass)
        offs = v0 + tl.arange(0, BLOCK_V)
        p, q = _race_weights(row, q_row, offs, offs < V, m, z, q_sum, x_rej, T, HAS_Q)
        res_sum += tl.sum(tl.maximum(p - q, 0.0), axis=0)
    use_res = rejected & (res_sum > TINY)  # an all-zero residual (p == q) falls back to p, as verify.py
    best = tl.full([], -1.0, tl.float32)  # below every weight / noise >= 0: an all-zero row picks index 0
    best_i = tl.full([], 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        p, q = _race_weights(row, q_row, offs, mask, m, z, q_sum, x_rej, T, HAS_Q)
        w = tl.where(use_res, tl.div_rn(tl.maximum(p - q, 0.0), tl.maximum(res_sum, TINY)), p)
        e = tl.maximum(tl.load(noise_ptr + r64 * stride_nr + offs, mask=mask, other=1.0), TINY)
        val = tl.where(mask, tl.div_rn(w, e), -1.0)
        blk = tl.max(val, axis=0)
        blk_i = tl.argmax(val, axis=0, tie_break_left=True) + v0
        take = blk > best  # strict: the earliest block keeps a tie (torch.argmax's first index)
        best_i = tl.where(take, blk_i, best_i)
        best = tl.where(take, blk, best)
    lp_last = tl.log(_p_of(logits_ptr, stats_ptr, r, n_acc, best_i, stride_lr, stride_ln, True, W, T))
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
) -> VerifyResult:
    """verify_sampling(chain proposal, processed_probs(logits, T), max_depth=D, max_children=1) in two kernels
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
    q_arg = q if q is not None else logits  # never read without HAS_Q
    stats = torch.empty(r, w, 3, dtype=torch.float32, device=dev)  # (m, Z, qsum) per node
    _node_stats_kernel[(r, w)](
        logits, q_arg, counts, stats, v, logits.stride(0), logits.stride(1), q_arg.stride(0), q_arg.stride(1),
        W=w, D=depth, T=float(temperature), HAS_Q=q is not None, BLOCK_V=blk, EMPTY_MAX=EMPTY_MAX, num_warps=4)
    out_tok = torch.empty(r, depth + 1, dtype=torch.int64, device=dev)
    out_lp = torch.empty(r, depth + 1, dtype=torch.float32, device=dev)
    out_acc = torch.empty(r, depth + 1, dtype=torch.int64, device=dev)
    out_n = torch.empty(r, dtype=torch.int64, device=dev)
    _chain_walk_kernel[(r,)](
        logits, q_arg, tokens, counts, stats, uniforms, noise, out_tok, out_lp, out_acc, out_n,
        v, logits.stride(0), logits.stride(1), q_arg.stride(0), q_arg.stride(1), tokens.stride(0),
        uniforms.stride(0), noise.stride(0),
        W=w, D=depth, T=float(temperature), HAS_Q=q is not None, BLOCK_D=triton.next_power_of_2(depth + 1),
        BLOCK_V=blk, TINY=TINY, num_warps=8)
    return VerifyResult(tokens=out_tok, num_emitted=out_n, accepted_nodes=out_acc, logprobs=out_lp)
