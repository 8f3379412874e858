"""A chain draft's sampling step in three Triton kernels: from the drafter's logits [B, V] to the drafted token and
the distribution q it was drawn from (the verifier's draft_probs row), for rows sharing one temperature T > 0 with no
top-k / top-p (DraftContext.filters). The torch path (processed_probs + sample) launches ~7 kernels per drafted
token whose softmax and argmax run one thread block per row: ~50 us per token at batch 8 over V = 49,152 on an H200
(bench/decode_profile.py), six times per chain of six.

1. kernels/sample_commit.py's chunk pass (grid (B, C)): the chunk's max m_c, sum of exp(s - m_c) and exponential-race
   winner, s = logits.float() / T rounded as torch rounds it;
2. one program per row merges the chunks: token (the race winner over all columns), m and Z;
3. grid (B, C) again: q = exp(s - m) / Z.
The token is drawn from softmax(s) (the race in the log domain, as sample_commit's), and q is that distribution in
fp32: the same law as sample(processed_probs(logits, T)), whose picks differ only on float near-ties.
With a draft vocabulary (`vocab`: the target id of each of the V' logit columns) the logits are the drafter's over
those ids only: the merge writes the winner's target id and the q pass scatters q into a zeroed row over the
target's vocabulary (`out`), so a restricted draft costs a V'-wide head and race, not a V-wide one.
No host sync and no data-dependent allocation: the chain draft's CUDA graph captures it.
Tests: `python -m pytest tests/kernels/test_kernels_draft_sample.py -q`.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from worker.tlt.kernels.common import pdl_args, wait_for_previous
from worker.tlt.kernels.sample_commit import TINY, _chunk_kernel, _merge_chunks, _scaled

CHUNK = 2048  # columns per (row, chunk) program, as sample_commit's


@triton.jit
def _merge_kernel(part_ptr, part_i_ptr, vocab_ptr, tok_ptr, stats_ptr, V, C, BLOCK_C: tl.constexpr,
                  HAS_VOCAB: tl.constexpr, USE_GDC: tl.constexpr):
    b = tl.program_id(0)
    wait_for_previous(USE_GDC)
    tok, m, z = _merge_chunks(part_ptr, part_i_ptr, b, V, C, BLOCK_C)
    if HAS_VOCAB:
        tok = tl.load(vocab_ptr + tok)
    tl.store(tok_ptr + b, tok.to(tl.int64))
    tl.store(stats_ptr + b * 2, m)
    tl.store(stats_ptr + b * 2 + 1, z)


@triton.jit
def _q_kernel(logits_ptr, stats_ptr, vocab_ptr, q_ptr, V, stride_l, stride_q, T, INV_T, MUL_INV: tl.constexpr,
              HAS_VOCAB: tl.constexpr, CH: tl.constexpr, USE_GDC: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1) * CH + tl.arange(0, CH)
    mask = cols < V
    # the logits before the wait: the head wrote them three kernels back (this one may only overlap the merge)
    x = tl.load(logits_ptr + b.to(tl.int64) * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous(USE_GDC)
    m = tl.load(stats_ptr + b * 2)
    z = tl.load(stats_ptr + b * 2 + 1)
    q = tl.exp(_scaled(x, T, INV_T, MUL_INV) - m) / z
    dst = cols
    if HAS_VOCAB:
        dst = tl.load(vocab_ptr + cols, mask=mask, other=0)
    tl.store(q_ptr + b.to(tl.int64) * stride_q + dst, q, mask=mask)


def draft_sample(
    logits: torch.Tensor,  # [B, V] bf16 / fp16 / fp32 drafter logits (last dim contiguous)
    noise: torch.Tensor,  # [B, V] fp32 Exp(1) draws
    temperature: float,  # > 0
    *,
    vocab: torch.Tensor | None = None,  # [V] int64 target id of each logit column (a draft vocabulary); None: ids
    out: torch.Tensor | None = None,  # [B, V_target] fp32 q's destination (last dim contiguous); with `vocab`, zeros
    #   outside it (the caller's, never written here)
    chunk: int = CHUNK,  # columns per chunk program, a power of 2 (tests force small ones)
) -> tuple[torch.Tensor, torch.Tensor]:  # (token [B] int64 target ids, q [B, V_target] fp32: `out` when given)
    """The drafted token and q = softmax(logits / T) (module docstring)."""
    b, v = logits.shape
    if temperature <= 0.0:
        raise ValueError("draft_sample samples (temperature > 0); greedy drafts take the torch path")
    if noise.shape != logits.shape or noise.dtype != torch.float32 or noise.stride(1) != 1:
        raise ValueError("draft_sample needs fp32 noise of the logits' shape, last dim contiguous")
    if vocab is not None and (vocab.shape != (v,) or vocab.dtype != torch.int64):
        raise ValueError(f"draft_sample's vocab maps each of the {v} logit columns to a target id (int64)")
    if vocab is not None and out is None:
        raise ValueError("draft_sample with a vocab writes q into `out` (zeros outside the vocab)")
    if out is not None and (out.shape[0] != b or out.dtype != torch.float32 or out.stride(1) != 1
                            or (vocab is None and out.shape[1] != v)):
        raise ValueError("draft_sample's out is [B, V_target] fp32, last dim contiguous")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    c = triton.cdiv(v, chunk)
    inv_t = float(np.float32(1.0) / np.float32(temperature))
    mul_inv = dev.type == "cuda"
    pdl = pdl_args(dev, b)
    part = torch.empty(b, c, 3, dtype=torch.float32, device=dev)
    part_i = torch.empty(b, c, dtype=torch.int32, device=dev)
    _chunk_kernel[(b, c)](logits, noise, part, part_i, part, part_i, v, c, logits.stride(0), noise.stride(0),
                          float(temperature), inv_t, GREEDY=False, USE_K=False, MUL_INV=mul_inv, KP=1, CH=chunk,
                          BITS=8 * logits.element_size(), TINY=TINY, **pdl, num_warps=4)
    tok = torch.empty(b, dtype=torch.int64, device=dev)
    stats = torch.empty(b, 2, dtype=torch.float32, device=dev)  # (m, Z) per row
    has_vocab = vocab is not None
    vmap = vocab if vocab is not None else tok  # unused pointers get any tensor
    _merge_kernel[(b,)](part, part_i, vmap, tok, stats, v, c, BLOCK_C=triton.next_power_of_2(c),
                        HAS_VOCAB=has_vocab, **pdl, num_warps=4)
    q = out if out is not None else torch.empty(b, v, dtype=torch.float32, device=dev)
    _q_kernel[(b, c)](logits, stats, vmap, q, v, logits.stride(0), q.stride(0), float(temperature), inv_t,
                      MUL_INV=mul_inv, HAS_VOCAB=has_vocab, CH=chunk, **pdl, num_warps=4)
    return tok, q
