"""The plain decode step's sampler and commit in two Triton kernels: from the lm head's logits [B, V] straight to the
committed row state, for a batch that is greedy or shares one setting (temperature T > 0, top-p off, top-k off or
small: `supported`). It replaces ~40 launch-bound torch kernels per step (processed_probs, pick_with_noise,
token_logprobs, RowState.commit_no_sync) and gives their result:
- greedy (T = 0): token = argmax(logits) (first index on ties), lp = log_softmax(logits.float())[token];
- sampled: s = logits.float() / T; with top-k, kept = {i : s_i >= the k-th largest s} (every tie at the k-th value
  is kept), else every column; token = the exponential race's winner over kept columns, argmax p_i / max(e_i, 1e-30)
  with e the caller's Exp(1) noise [B, V] (first index on ties); lp = log p_token, p = softmax of s over kept;
- commit: RowState.commit_no_sync of a run of width 1 (EOS, max_new_tokens, done rows write into column `cap`).

The race runs in the log domain, s_i - log(max(e_i, 1e-30)): that is log(p_i / e_i) plus the row constant m + log Z,
so it orders columns as torch's p_i / e_i does without needing the row's max and sum first. A pick differs from
torch's only where two race values agree to ~1e-6 relative (float rounding). s is rounded as torch rounds it on
each device: a true division on CPU, x * fl(1 / T) on CUDA (torch multiplies by the reciprocal of a scalar divisor).

The vocabulary is split into C chunks of CH columns, so that the pass over V runs in (row, chunk) programs:
- `_chunk_kernel` (B, C): greedy / no top-k: the chunk's max m_c, sum of exp(s - m_c) and race winner (or argmax);
  top-k: the chunk's KP largest RAW logits x (KP = next_pow2(k + 1); ties at the KP-th by lowest column) and their
  columns, found by a radix select on x's bits (no sort): 16 counting steps for bf16 / fp16 logits, 32 for fp32;
- `_finish_kernel` (B): merges the chunks (m = max m_c, Z = sum Z_c exp(m_c - m); winner = max, lowest column on a
  tie) or, with top-k: kth = scale(the k-th largest candidate x) (exact: a chunk's share of the global top-k is in
  its own top-KP), then Z and the race over the candidates with s >= kth, with the noise gathered at them only. A
  full chunk whose smallest candidate s is still >= kth may hold columns with s >= kth it did not store: it is
  rescanned whole from the logits (rare: see below; an all-equal row keeps all V). Then the commit.

Top-k on the raw logits, exactly. scale(x) = fl(x / T) (CPU) or fl(x * fl(1 / T)) (CUDA) is monotone non-decreasing
for T > 0 (a positive factor, then rounding, which is monotone), so the k-th largest s is scale(the k-th largest x):
the select runs on x's 16-bit order for 16-bit logits. Rounding may map several x to one s, so the kept set is
{i : s_i >= kth} on s (a column with x below the k-th x can still reach kth), and the rescan rule is unchanged: a
column a full chunk did not store has x <= its smallest stored x, hence s <= its smallest stored s (monotone), so a
chunk whose smallest stored s is < kth holds no unstored kept column; one whose smallest stored s is >= kth may, and
is rescanned. (The rule on x, smallest stored x >= the k-th x, would be wrong: it misses a chunk whose smallest x is
below the k-th x but rounds to kth.) A chunk is rescanned only if it holds >= KP - k + 1 columns whose s ties kth.
No host sync and no data-dependent allocation: it runs inside the decode step's CUDA graph.
Tests: `python -m pytest tests/kernels/test_kernels_sample_commit.py -q` (CPU interpreter; `-m gpu` at V = 49152).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from worker.tlt.kernels.common import pdl_args, wait_for_previous
from worker.tlt.kernels.settings import current
from worker.tlt.rollout.state import RowState

TINY = 1e-30  # pick_with_noise's noise floor
MAX_TOP_K = 256  # larger k: torch's topk
# Columns per (row, chunk) program, one tile: the first whose candidates fit MERGE_SLOTS. 2048 (24 programs at
# V = 49152, 4 warps) rather than more, smaller chunks: each radix step's cost is mostly its block-wide reduction
# (shared memory + barrier), about the same at 16 or 4 columns per thread, while the finish kernel, one program per
# row, selects over C x KP candidates: 4x the chunks is 4x its tile for a small gain in the parallel kernel.
CHUNKS = (2048, 4096)
MERGE_SLOTS = 8192  # candidate slots (chunks x KP, powers of 2) the finish kernel holds in one tile


def _chunk_for(top_k: int, vocab: int) -> int | None:
    """Columns per chunk for this top-k (None: its candidates never fit one finish tile)."""
    kp = _slots(top_k, vocab)
    for ch in CHUNKS:
        ch = max(min(ch, triton.next_power_of_2(vocab)), kp)
        if triton.next_power_of_2(triton.cdiv(vocab, ch)) * kp <= MERGE_SLOTS:
            return ch
    return None


def _slots(top_k: int, vocab: int) -> int:
    """Candidates per chunk: KP = next_pow2(k + 1) with top-k on, else 1 (no candidates)."""
    return triton.next_power_of_2(top_k + 1) if 0 < top_k < vocab else 1


def supported(top_k: int, vocab: int, batch: int = 1) -> bool:
    """Whether the kernels take this top-k for this many rows: off (<= 0 or >= vocab), or at most MAX_TOP_K with every
    chunk's candidates fitting one tile of the finish kernel (k <= 256 at V = 49152; k <= 127 at V = 151936); and
    at most KernelConfig.sampler_max_batch rows."""
    if batch > current().sampler_max_batch:
        return False
    if top_k <= 0 or top_k >= vocab:
        return True
    return top_k <= MAX_TOP_K and _chunk_for(top_k, vocab) is not None


@triton.jit
def _scaled(x, T, INV_T, MUL_INV: tl.constexpr):
    """logits.float() / T as torch rounds it (module docstring)."""
    if MUL_INV:
        return x * INV_T
    return tl.div_rn(x, T)


@triton.jit
def _key(x, BITS: tl.constexpr):
    """Raw logits (BITS 16: bf16 / fp16; 32: fp32) -> keys in [0, 2^BITS) with the floats' order (-0.0 just below
    +0.0): int32 for 16 bits, int64 for 32 (the unsigned range)."""
    if BITS == 16:
        b = x.to(tl.int16, bitcast=True).to(tl.int32)
        return tl.where(b >= 0, b, b ^ 0x7FFF) + 32768
    else:
        b = x.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64) + 2147483648


@triton.jit
def _from_key(u, like):
    """The inverse of `_key`: the value of `like`'s dtype whose key is u."""
    if like.dtype.primitive_bitwidth == 16:
        o = (u - 32768).to(tl.int16)
        return tl.where(o >= 0, o, o ^ 0x7FFF).to(like.dtype, bitcast=True)
    else:
        o = (u - 2147483648).to(tl.int32)
        return tl.where(o >= 0, o, o ^ 0x7FFFFFFF).to(like.dtype, bitcast=True)


@triton.jit
def _kth_largest(u, live, K, BITS: tl.constexpr):
    """The K-th largest of u (`_key`, any shape) over the live lanes, bit by bit from the top (BITS counting steps):
    the largest t with at least K live lanes >= t. Fewer than K live lanes: 0."""
    t = tl.zeros([], u.dtype)
    for i in range(BITS):
        trial = t | (tl.full([], 1, u.dtype) << (BITS - 1 - i))
        t = tl.where(tl.sum((live & (u >= trial)).to(tl.int32)) >= K, trial, t)
    return t


@triton.jit
def _race(s, cols, kept, noise_row, m, z, best, best_i, V, TINY: tl.constexpr):
    """Add the kept lanes (any shape) to the row's Z (relative to m) and to its race (best score, its column)."""
    e = tl.load(noise_row + cols, mask=kept, other=1.0)
    score = tl.where(kept, s - tl.log(tl.maximum(e, TINY)), float("-inf"))
    z += tl.sum(tl.where(kept, tl.exp(s - m), 0.0))
    top = tl.max(score)
    top_i = tl.min(tl.where(kept & (score == top), cols, V))
    take = (top > best) | ((top == best) & (top_i < best_i))
    return z, tl.where(take, top, best), tl.where(take, top_i, best_i)


@triton.jit
def _chunk_kernel(
    logits_ptr, noise_ptr, part_ptr, part_i_ptr, cand_x_ptr, cand_i_ptr, V, C, stride_l, stride_n, T, INV_T,
    GREEDY: tl.constexpr, USE_K: tl.constexpr, MUL_INV: tl.constexpr, KP: tl.constexpr, CH: tl.constexpr,
    BITS: tl.constexpr, TINY: tl.constexpr, USE_GDC: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * CH + tl.arange(0, CH)
    mask = cols < V
    wait_for_previous(USE_GDC)
    x = tl.load(logits_ptr + b.to(tl.int64) * stride_l + cols, mask=mask, other=float("-inf"))  # raw dtype
    if USE_K:
        # the KP largest raw logits (module docstring): every lane above the KP-th key t, then lanes equal to t by
        # column until KP are taken
        u = _key(x, BITS)
        t = _kth_largest(u, mask, KP, BITS)  # 0 when the chunk has fewer than KP columns: all of them are taken
        gt = mask & (u > t)
        eq = mask & (u == t)
        n_gt = tl.sum(gt.to(tl.int32), axis=0)
        eq_rank = n_gt + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        take = gt | (eq & (eq_rank < KP))
        slot = tl.where(gt, tl.cumsum(gt.to(tl.int32), axis=0) - 1, eq_rank)
        base = (b * C + c).to(tl.int64) * KP
        tl.store(cand_x_ptr + base + slot, x, mask=take)
        tl.store(cand_i_ptr + base + slot, cols, mask=take)
        j = tl.arange(0, KP)
        empty = j >= tl.sum(take.to(tl.int32), axis=0)  # slots past the taken ones: padding (column V)
        tl.store(cand_x_ptr + base + j, tl.full([KP], float("-inf"), x.dtype), mask=empty)
        tl.store(cand_i_ptr + base + j, tl.zeros([KP], tl.int32) + V, mask=empty)
    else:
        s = x.to(tl.float32)
        if not GREEDY:
            s = _scaled(s, T, INV_T, MUL_INV)
        m = tl.max(s, axis=0)
        z = tl.sum(tl.exp(s - tl.where(m == float("-inf"), 0.0, m)), axis=0)  # an all -inf chunk: Z = 0, no NaN
        if GREEDY:
            best = m
            best_i = tl.min(tl.where(mask & (s == m), cols, V), axis=0)
        else:
            e = tl.load(noise_ptr + b.to(tl.int64) * stride_n + cols, mask=mask, other=1.0)
            score = tl.where(mask, s - tl.log(tl.maximum(e, TINY)), float("-inf"))
            best = tl.max(score, axis=0)
            best_i = tl.min(tl.where(mask & (score == best), cols, V), axis=0)
        part = part_ptr + (b * C + c) * 3
        tl.store(part, m)
        tl.store(part + 1, z)
        tl.store(part + 2, best)
        tl.store(part_i_ptr + b * C + c, best_i)


@triton.jit
def _merge_chunks(part_ptr, part_i_ptr, b, V, C, BLOCK_C: tl.constexpr):
    """Greedy / no top-k: (token, m, Z) of row b from its chunks' (m_c, Z_c, best) and winners."""
    cs = tl.arange(0, BLOCK_C)
    ok = cs < C
    part = part_ptr + (b * C + cs) * 3
    m_c = tl.load(part, mask=ok, other=float("-inf"))
    m = tl.max(m_c, axis=0)
    z = tl.sum(tl.load(part + 1, mask=ok, other=0.0) * tl.exp(m_c - m), axis=0)
    best_c = tl.load(part + 2, mask=ok, other=float("-inf"))
    best = tl.max(best_c, axis=0)
    tok = tl.min(tl.where(ok & (best_c == best), tl.load(part_i_ptr + b * C + cs, mask=ok, other=V), V), axis=0)
    return tok, m, z


@triton.jit
def _top_k_race(
    logits_ptr, noise_row, cand_x_ptr, cand_i_ptr, b, V, C, K, stride_l, T, INV_T,
    MUL_INV: tl.constexpr, KP: tl.constexpr, CH: tl.constexpr, BITS: tl.constexpr, BLOCK_C: tl.constexpr,
    TINY: tl.constexpr,
):
    """Top-k: (token, m, Z) of row b from its chunks' candidates (module docstring)."""
    cs = tl.arange(0, BLOCK_C)
    slot = (b * C + cs[:, None]).to(tl.int64) * KP + tl.arange(0, KP)[None, :]  # [BLOCK_C, KP]
    live = (cs < C)[:, None]
    x = tl.load(cand_x_ptr + slot, mask=live, other=float("-inf"))  # raw dtype
    col = tl.load(cand_i_ptr + slot, mask=live, other=V)
    valid = col < V
    kth_x = _from_key(_kth_largest(_key(x, BITS), valid, K, BITS), x)
    kth = _scaled(kth_x.to(tl.float32), T, INV_T, MUL_INV)  # the k-th largest s: scaling is monotone
    s = _scaled(x.to(tl.float32), T, INV_T, MUL_INV)
    m = tl.max(tl.where(valid, s, float("-inf")))
    # chunks that may hold columns with s >= kth they did not store (module docstring: the test is on s, not x):
    # all KP slots taken and the smallest s still >= kth
    full = tl.sum(valid.to(tl.int32), axis=1) == KP
    rescan = full & (tl.min(tl.where(valid, s, float("inf")), axis=1) >= kth)  # [BLOCK_C]
    kept = valid & (s >= kth) & (rescan[:, None] == 0)
    z, best, best_i = _race(s, col, kept, noise_row, m, tl.zeros([], tl.float32),
                            tl.full([], float("-inf"), tl.float32), tl.zeros([], tl.int32) + V, V, TINY)
    pending = rescan
    for _ in range(tl.sum(rescan.to(tl.int32), axis=0)):  # rare: each such chunk whole, from the logits
        c = tl.min(tl.where(pending, cs, BLOCK_C), axis=0)
        pending = pending & (cs != c)
        cols = c * CH + tl.arange(0, CH)
        mask = cols < V
        sc = tl.load(logits_ptr + b.to(tl.int64) * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
        sc = _scaled(sc, T, INV_T, MUL_INV)
        z, best, best_i = _race(sc, cols, mask & (sc >= kth), noise_row, m, z, best, best_i, V, TINY)
    return best_i, m, z


@triton.jit
def _commit(tok, lp, b, done_ptr, max_new_ptr, n_gen_ptr, eos_ptr, out_tok_ptr, out_lp_ptr, last_ptr, lens_ptr,
            n_ptr, cap, E, stride_eos, stride_out, BLOCK_E: tl.constexpr):
    """RowState.commit_no_sync of row b's run of width 1: cut at max_new_tokens (an EOS is emitted and finishes
    the row); done rows emit nothing and write into the scratch column `cap`."""
    tok = tok.to(tl.int64)
    done_u8 = tl.load(done_ptr + b)
    done = done_u8 != 0
    n_gen = tl.load(n_gen_ptr + b)
    remaining = tl.load(max_new_ptr + b) - n_gen
    e = tl.arange(0, BLOCK_E)
    is_eos = tl.max((tl.load(eos_ptr + b * stride_eos + e, mask=e < E, other=-1) == tok).to(tl.int32), axis=0) > 0
    n = tl.where(done, 0, tl.maximum(tl.minimum(remaining, 1), 0))
    finished = (done_u8 == 0) & ((is_eos & (n > 0)) | (n >= remaining))
    col = tl.where(n > 0, n_gen, cap)
    tl.store(out_tok_ptr + b * stride_out + col, tok)
    tl.store(out_lp_ptr + b * stride_out + col, lp)
    tl.store(last_ptr + b, tl.where(n > 0, tok, tl.load(last_ptr + b)))
    tl.store(lens_ptr + b, tl.load(lens_ptr + b) + n)
    tl.store(n_gen_ptr + b, n_gen + n)
    tl.store(done_ptr + b, (done | finished).to(tl.uint8))
    tl.store(n_ptr + b, n)


@triton.jit
def _finish_kernel(
    logits_ptr, noise_ptr, part_ptr, part_i_ptr, cand_x_ptr, cand_i_ptr,
    done_ptr, max_new_ptr, n_gen_ptr, eos_ptr, out_tok_ptr, out_lp_ptr, last_ptr, lens_ptr, n_ptr,
    V, C, K, cap, E, stride_l, stride_n, stride_eos, stride_out, T, INV_T,
    GREEDY: tl.constexpr, USE_K: tl.constexpr, MUL_INV: tl.constexpr, KP: tl.constexpr, CH: tl.constexpr,
    BITS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, TINY: tl.constexpr, USE_GDC: tl.constexpr,
):
    b = tl.program_id(0)
    wait_for_previous(USE_GDC)
    if USE_K:
        tok, m, z = _top_k_race(logits_ptr, noise_ptr + b.to(tl.int64) * stride_n, cand_x_ptr, cand_i_ptr, b, V, C,
                                K, stride_l, T, INV_T, MUL_INV, KP, CH, BITS, BLOCK_C, TINY)
    else:
        tok, m, z = _merge_chunks(part_ptr, part_i_ptr, b, V, C, BLOCK_C)
    s_tok = tl.load(logits_ptr + b.to(tl.int64) * stride_l + tok).to(tl.float32)
    if not GREEDY:
        s_tok = _scaled(s_tok, T, INV_T, MUL_INV)
    lp = (s_tok - m) - tl.log(z)  # log p_token (sampled) / log_softmax (greedy)
    _commit(tok, lp, b, done_ptr, max_new_ptr, n_gen_ptr, eos_ptr, out_tok_ptr, out_lp_ptr, last_ptr, lens_ptr,
            n_ptr, cap, E, stride_eos, stride_out, BLOCK_E)


def sample_commit(
    logits: torch.Tensor,  # [B, V] bf16 / fp16 / fp32 head logits (last dim contiguous)
    noise: torch.Tensor | None,  # [B, V] fp32 Exp(1) draws (None: greedy)
    rows: RowState,  # rows row0..row0+B-1 commit; the rest are untouched
    batch: int,  # B
    temperature: float,  # 0: greedy
    top_k: int,  # <= 0 or >= V: off (`supported` says which others)
    *,
    row0: int = 0,  # first row (prefill's first tokens go to the rows past the active ones)
    chunk_v: int | None = None,  # columns per chunk, a power of 2 (tests force small ones; raised to KP)
) -> torch.Tensor:  # [B] int64 tokens emitted per row
    """Sample one token per row and commit it (module docstring): what processed_probs + pick_with_noise +
    token_logprobs + RowState.commit_no_sync(slice(row0, row0 + B), tok[:, None], lp[:, None], ones) leave behind."""
    b, v = logits.shape
    if b != batch:
        raise ValueError(f"logits have {b} rows for a batch of {batch}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"logits must be bf16, fp16 or fp32, not {logits.dtype}")
    greedy = temperature <= 0.0
    if not greedy and (noise is None or noise.dtype != torch.float32 or noise.stride(1) != 1):
        raise ValueError("sampling (temperature > 0) needs fp32 noise [B, V], last dim contiguous")
    use_k = not greedy and 0 < top_k < v
    kp = _slots(top_k, v) if use_k else 1
    chunk = max(chunk_v, kp) if chunk_v else _chunk_for(top_k if use_k else 0, v)
    if not supported(top_k if use_k else 0, v) or chunk is None or chunk & (chunk - 1) or chunk < kp:
        raise ValueError(f"top_k {top_k} at V = {v} (chunk {chunk}) is not supported: use the torch path")
    c = triton.cdiv(v, chunk)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    noise_arg = logits if noise is None else noise  # never read when greedy
    t = 1.0 if greedy else float(temperature)
    inv_t = float(np.float32(1.0) / np.float32(t))
    part = torch.empty(b, c, 3, dtype=torch.float32, device=dev)  # (m_c, Z_c, best race value) per chunk
    part_i = torch.empty(b, c, dtype=torch.int32, device=dev)  # the chunk's winner
    cand_x, cand_i = part, part_i  # top-k candidates (raw logit, column) per chunk; not read without top-k
    if use_k:
        cand_x = torch.empty(b, c, kp, dtype=logits.dtype, device=dev)
        cand_i = torch.empty(b, c, kp, dtype=torch.int32, device=dev)
    consts = dict(GREEDY=greedy, USE_K=use_k, MUL_INV=dev.type == "cuda", KP=kp, CH=chunk,
                  BITS=8 * logits.element_size(), TINY=TINY, **pdl_args(dev, b))
    _chunk_kernel[(b, c)](logits, noise_arg, part, part_i, cand_x, cand_i, v, c, logits.stride(0),
                          noise_arg.stride(0), t, inv_t, **consts, num_warps=max(4, chunk // 512))
    n = torch.empty(b, dtype=torch.int64, device=dev)
    e = rows.eos.shape[1]
    block_c = triton.next_power_of_2(c)
    done, max_new, n_gen, eos, out_tok, out_lp, last, lens = (
        t[row0:] for t in (rows.done.view(torch.uint8), rows.max_new, rows.n_gen, rows.eos, rows.out_tok, rows.out_lp,
                           rows.last, rows.lens))
    _finish_kernel[(b,)](
        logits, noise_arg, part, part_i, cand_x, cand_i, done, max_new, n_gen, eos, out_tok, out_lp, last, lens, n,
        v, c, top_k, rows.cap, e, logits.stride(0),
        noise_arg.stride(0), rows.eos.stride(0), rows.out_tok.stride(0), t, inv_t, **consts, BLOCK_C=block_c,
        BLOCK_E=triton.next_power_of_2(e), num_warps=max(4, min(16, block_c * kp // 512)))
    return n
