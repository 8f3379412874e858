"""`gemm_forward_hidden`: the engine's cached forward for models too large for the fused kernels to pay (layers over
`GEMM_LAYER_BYTES`: `prefers_gemm`): cuBLAS for the five weight matrices, and between them the few Triton kernels of kernels/glue.py
and the cache attention of kernels/attention.py: nine launches per layer (eleven with cuBLAS's split-K reductions;
an H200 step of Qwen2.5-7B: 311 kernels) where the torch forward takes ~23 (599):

  qkv = F.linear(y, W_qkv, b)          q = rope_cache(qkv)        (K, V into the cache)
  a = cache_attention(q)               h, y = add_rms_norm(F.linear(a, W_o), x)
  u = silu_mul(F.linear(y, W_gu))      x, y = add_rms_norm(F.linear(u, W_down), h)   (y: the next layer's norm)

Why not the fused kernels there: at a 7B shape one decode token spends ~3.7 ms in cuBLAS's GEMV-shaped kernels
(3.7-4.0 TB/s on the 136-272 MB matrices of an H200) against ~4.5 ms in the fused kernels, whose 16-row M tiles also
re-read the weights per tile (a verify of 8 tokens over 8 rows: 2x a decode step, cuBLAS 1.09x). What the torch
forward loses there is its ~1 ms of small elementwise kernels and SDPA's attention, which at 3,500 cache columns took
4.3 ms of a 9.2 ms step (4 rows); both are the Triton kernels here.

Batch invariance: cuBLAS picks its kernel (tiles, split-K) per M, so a row's logits may differ in the last bit between
a decode call and a verify call of another size. Sampling stays exact (each forward's distribution is its own), but a
greedy run with SD can part from plain greedy at a near tie; `pad_rows` (KernelConfig.gemm_pad_rows) runs every GEMM
at one fixed M so that a row's result never depends on the call: what the bf16 identical-token tests use.
Same inputs and outputs as `Transformer.forward_hidden` with a cache. Tests: `python -m pytest
tests/kernels/test_kernels_gemm_forward.py -q`.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from worker.tlt.kernels.attention import cache_attention
from worker.tlt.kernels.cached_call import CachedCall, CachedForward
from worker.tlt.kernels.glue import add_rms_norm, rope_cache, silu_mul
from worker.tlt.kernels.settings import current
from worker.tlt.model.args import ModelArgs
from worker.tlt.model.roofline import layer_bytes
from worker.tlt.model.transformer import DecoderLayer, LayerCache, Transformer

# The fused kernels re-read a layer's weights per 16-row tile: free while they stay in L2 (SmolLM2-135M, 7 MB a
# layer: 51,151 tok/s fused vs 23,820 torch at batch 64 on an H200), not above: at Qwen2.5-1.5B (94 MB a layer) batch
# 1 ran 403 tok/s fused vs 592 here, at 7B 5.9 ms vs 4.9 ms (torch) per step, and an EAGLE drafter layer at a 7B
# width (466 MB) spent 1.1 ms per draft token in them against ~0.25 ms of GEMV-bound cuBLAS.
GEMM_LAYER_BYTES = 32 << 20


def prefers_gemm(args: ModelArgs, dtype_bytes: int) -> bool:
    """Whether a model (or a drafter layer) of `args` runs this module's GEMMs rather than the fused kernels."""
    return layer_bytes(args, dtype_bytes) > GEMM_LAYER_BYTES


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ b) in cuBLAS; with KernelConfig.gemm_pad_rows > 0, at exactly that many rows (the rows past x's
    zero) so that each row's result is the same in any call of up to that many rows."""
    pad = current().gemm_pad_rows
    m = x.shape[0]
    if pad <= 0 or m >= pad:
        return F.linear(x, w, b)
    xp = x.new_zeros((pad, x.shape[1]))
    xp[:m] = x
    return F.linear(xp, w, b)[:m]


def _gemm_layers(model: Transformer, x: torch.Tensor, call: CachedCall, cache: LayerCache) -> torch.Tensor:
    """The decoder layers and the final norm (fused into the last down's residual add): nine launches a layer."""
    blocks = cast(list[DecoderLayer], model.model.layers)
    eps = call.eps
    x, y = add_rms_norm(x, None, blocks[0].input_layernorm.weight, eps)
    for i, layer in enumerate(blocks):
        call.capture(i, x)
        att, mlp = layer.self_attn, layer.mlp
        ck, cv = cache.k[i], cache.v[i]
        qkv = linear(y, att.qkv_proj.weight, att.qkv_proj.bias)
        q = rope_cache(qkv, att.q_norm.weight if att.q_norm is not None else None,
                       att.k_norm.weight if att.k_norm is not None else None, model.rope_cos, model.rope_sin,
                       call.pos, call.widx, ck, cv, s=call.s, row0=call.row0, n_heads=model.args.n_heads, eps=eps,
                       table=call.table)
        a = cache_attention(q, ck, cv, call.mask, call.widx, row0=call.row0, table=call.table)
        h, y = add_rms_norm(linear(a, att.o_proj.weight), x, layer.post_attention_layernorm.weight, eps)
        u = silu_mul(linear(y, mlp.gate_up_proj.weight))
        nxt = blocks[i + 1].input_layernorm.weight if i + 1 < len(blocks) else model.model.norm.weight
        x, y = add_rms_norm(linear(u, mlp.down_proj.weight), h, nxt, eps)
    return y  # the final norm's output


# (logits, final-norm hidden [B, S, H], {i: hidden entering layer i}) as model.forward_hidden with a cache
gemm_forward_hidden = CachedForward(_gemm_layers, linear)
