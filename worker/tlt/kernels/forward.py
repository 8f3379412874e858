"""`fused_forward_hidden`: `Transformer.forward_hidden` for the engine's CACHED calls (decode and speculative verify)
in five Triton kernels per layer instead of ~25 torch kernels:

  1. input norm + q|k|v GEMM (+bias) (+q/k norm) + RoPE + K/V written into the cache  (kernels/qkv_rope.py)
  2. attention over the cache row with the boolean mask                             (kernels/attention.py)
  3. o_proj GEMM + residual                                                          (kernels/linear.py)
  4. post-attention norm + gate|up GEMM + silu(gate) * up                             (kernels/linear.py)
  5. down GEMM + residual                                                            (kernels/linear.py)

The embedding and the final norm stay in torch; the head is `linear_residual` without a residual. Same inputs and
outputs as forward_hidden with a cache, for the small token counts of decode / verify and of small prefill chunks
(rollout/prefill.py: up to FUSED_PREFILL_TOKENS; larger chunks, and calls over EngineConfig.fused_max_seqs sequences,
keep torch: rollout/decode_step.py). `cached_forward` picks kernels/gemm_forward.py instead for models of large layers (`prefers_gemm`: cuBLAS
GEMMs, Triton between them) at any batch. Inference only: runs under no_grad, no host
sync and no data-dependent allocation, so a CUDA graph can capture it. On CPU it runs in Triton's interpreter
(TRITON_INTERPRET=1 set before this package is imported). Tests: `python -m pytest tests/kernels -q`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch

from worker.tlt.kernels.attention import cache_attention
from worker.tlt.kernels.cached_call import CachedCall, CachedForward
from worker.tlt.kernels.gemm_forward import gemm_forward_hidden, prefers_gemm
from worker.tlt.kernels.linear import linear_residual, norm_gate_up
from worker.tlt.kernels.qkv_rope import qkv_rope_cache
from worker.tlt.model.transformer import DecoderLayer, LayerCache, Transformer

# The kernels tile the tokens by 16 rows and every tile reads the weights again: free while the weights stay in L2
# (SmolLM2, 270 MB, batch 64 on an H200: 51,151 tok/s fused vs 23,820 torch), not above (kernels/gemm_forward.py).


def cached_forward(model: Transformer) -> Callable[..., tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]]:
    """The engine's cached forward for `model` (Transformer.forward_hidden's arguments but the model): the fused
    kernels, or kernels/gemm_forward.py's for a model of large layers."""
    if prefers_gemm(model.args, model.head_weight.element_size()):
        return functools.partial(gemm_forward_hidden, model)
    return functools.partial(fused_forward_hidden, model)


def _fused_layers(model: Transformer, x: torch.Tensor, call: CachedCall, cache: LayerCache) -> torch.Tensor:
    """The decoder layers and the final norm: five kernels a layer."""
    for i, layer in enumerate(cast(list[DecoderLayer], model.model.layers)):
        call.capture(i, x)
        att, mlp = layer.self_attn, layer.mlp
        ck, cv = cache.k[i], cache.v[i]
        q = qkv_rope_cache(
            x, layer.input_layernorm.weight, att.qkv_proj.weight, att.qkv_proj.bias,
            att.q_norm.weight if att.q_norm is not None else None,
            att.k_norm.weight if att.k_norm is not None else None,
            model.rope_cos, model.rope_sin, call.pos, call.widx, ck, cv, s=call.s, row0=call.row0,
            n_heads=model.args.n_heads, eps=call.eps, table=call.table,
        )
        a = cache_attention(q, ck, cv, call.mask, call.widx, row0=call.row0, table=call.table)
        # each residual was written two or more kernels back (x: the last layer's down, h: o_proj before norm_gate_up)
        h = linear_residual(a, att.o_proj.weight, x, early_residual=True)
        u = norm_gate_up(h, layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, call.eps)
        x = linear_residual(u, mlp.down_proj.weight, h, early_residual=True)
    return model.model.norm(x.view(call.b, call.s, -1))


def _triton_head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The head in Triton too: cuBLAS would pick another kernel per batch size (logits no longer batch-invariant)."""
    return linear_residual(hidden, weight, None)


# (logits, final-norm hidden [B, S, H], {i: hidden entering layer i}) as model.forward_hidden with a cache
fused_forward_hidden = CachedForward(_fused_layers, _triton_head)
