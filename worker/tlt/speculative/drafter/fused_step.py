"""`fused_drafter_step`: `EagleDrafter.step` of an EAGLE-1 drafter writing into a preallocated `DraftKV` (the chain
draft's context forward and its one-token steps) on the target's fused Triton kernels (worker/tlt/kernels/) instead of
~30 torch kernels:

  x   = fc(concat(embed(tok), h))        linear_residual gathering the embedding rows itself (no concat)
  q   = rope(x @ Wqkv^T), K/V -> past    qkv_rope_cache with no input norm (EAGLE-1's layer has none), the
                                         target's RoPE tables (positions clamped into them by the kernel), K/V
                                         written at columns write_at + s of past.k / past.v
  o   = attention(q, past, mask)         cache_attention over columns 0..write_at + s of each entry
  a   = x + o_proj(o)                    linear_residual
  out = a + down(silu(g) * u)            norm_gate_up (post_attention_layernorm), linear_residual

A drafter layer of a large target (`prefers_gemm`: a 7B-class width) runs the large-model forward's pieces instead
(kernels/gemm_forward.py): cuBLAS for fc, q|k|v, o, gate|up and down, with rope_cache, cache_attention, add_rms_norm
and silu_mul between them.

The drafter layer has the target's shapes and DraftKV's [B, Hkv, T, D] buffers are a KV cache of B slots (row0 = 0),
so the target's kernels run it unchanged. The attention kernel reads, for entry s, only the columns up to its own
(write_at + s) and skips those its mask row forbids: exact for the causal masks chain drafting builds, never for a
mask that lets an entry see columns to its right. Inference only (no autograd), no host sync, fixed shapes: a CUDA
graph captures it. Six kernels per step: a chain draft of k tokens runs k + 1 steps. The dispatch lives in `EagleDrafter.step` (its `fused` flag); on CPU the kernels run in Triton's
interpreter (TRITON_INTERPRET=1 before importing this module).

Run the tests: `python -m pytest tests/drafter/test_drafter_fused_step.py -q` (GPU: add `-m gpu`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from worker.tlt.kernels.attention import cache_attention
from worker.tlt.kernels.gemm_forward import prefers_gemm
from worker.tlt.kernels.glue import add_rms_norm, rope_cache, silu_mul
from worker.tlt.kernels.linear import linear_residual, norm_gate_up
from worker.tlt.kernels.qkv_rope import qkv_rope_cache
from worker.tlt.model.args import ModelArgs
from worker.tlt.model.transformer import MLP, Attention, RMSNorm, Transformer
from worker.tlt.speculative.drafter.draft_kv import DraftKV


class DrafterLayer(Protocol):
    """What the fused step reads of an EAGLE-1 drafter (speculative/drafter/model.EagleDrafter, which calls this module)."""

    args: ModelArgs
    fc: nn.Linear
    self_attn: Attention
    mlp: MLP
    post_attention_layernorm: RMSNorm

    @property
    def target(self) -> Transformer: ...

    @property
    def embed_weight(self) -> torch.Tensor: ...


def rope_mismatch(drafter: DrafterLayer) -> str | None:
    """Why the target's RoPE tables cannot stand in for the drafter's own RoPE (None: they can)."""
    t, a = drafter.target, drafter.args
    if t.rope_cos.numel() == 0:
        return "the target's RoPE tables are not initialised (Transformer.init_rope)"
    ours = (a.hd, a.rope_theta, a.rope_scaling)
    theirs = (t.args.hd, t.args.rope_theta, t.args.rope_scaling)
    if ours != theirs or t.rope_cos.shape[-1] != a.hd:
        return f"the drafter's RoPE {ours} is not the target's {theirs}"
    return None


_COLUMNS: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}


def _write_columns(write_at: int, s: int, b: int, device: torch.device) -> torch.Tensor:  # [B * S] int64
    """Cache columns write_at .. write_at + S - 1 of each row: made once per shape, so a captured draft replays no
    kernel for them (a constant; nothing writes it)."""
    key = (write_at, s, b, device)
    cols = _COLUMNS.get(key)
    if cols is None:
        cols = torch.arange(write_at, write_at + s, device=device).repeat(b)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):  # a capture only records it
            _COLUMNS[key] = cols
    return cols


@torch.no_grad()
def fused_drafter_step(
    drafter: DrafterLayer,
    tokens: torch.Tensor,  # [B, S] token x_{j+1} of each new entry
    hidden: torch.Tensor,  # [B, S, H] target feature (first step) or the drafter's previous `out`
    positions: torch.Tensor,  # [B, S] RoPE positions
    past: DraftKV,  # preallocated K/V buffers, each [B, Hkv, T, D] (written at columns write_at..write_at + S - 1)
    mask: torch.Tensor,  # [B, S, write_at + S] bool, True = attend; causal (see the module docstring)
    write_at: int,
) -> tuple[torch.Tensor, DraftKV]:  # out [B, S, H] (pre-norm feature), past (the same buffers)
    """What `drafter.step(tokens, hidden, positions, past, mask, write_at)` returns, on the fused kernels."""
    b, s = tokens.shape
    a, t = drafter.args, drafter.target
    m, h, dt = b * s, a.dim, drafter.fc.weight.dtype
    embed = drafter.embed_weight.detach()
    if embed.dtype != dt:
        raise ValueError(f"the fused drafter step reads the target's embedding as is: {embed.dtype}, not {dt}")
    hid = hidden.reshape(m, h).to(dt)
    pos = positions.reshape(m).contiguous()  # [M] (the RoPE kernels clamp them into the target's table)
    widx = _write_columns(write_at, s, b, tokens.device)  # [M] cache column of each entry
    at, mlp = drafter.self_attn, drafter.mlp
    if prefers_gemm(a, drafter.fc.weight.element_size()):
        x = F.linear(torch.cat([F.embedding(tokens.reshape(m), embed), hid], dim=-1), drafter.fc.weight)
        q = rope_cache(F.linear(x, at.qkv_proj.weight, at.qkv_proj.bias), None, None, t.rope_cos, t.rope_sin, pos,
                       widx, past.k, past.v, s=s, row0=0, n_heads=a.n_heads, eps=a.norm_eps)
        o = cache_attention(q, past.k, past.v, mask, widx, row0=0)
        h1, y = add_rms_norm(F.linear(o, at.o_proj.weight), x, drafter.post_attention_layernorm.weight, a.norm_eps)
        out = torch.addmm(h1, silu_mul(F.linear(y, mlp.gate_up_proj.weight)), mlp.down_proj.weight.t())
        return out.view(b, s, h), past
    x = linear_residual(hid, drafter.fc.weight, None, gather=(embed, tokens.reshape(m)))  # [M, H]
    q = qkv_rope_cache(x, None, at.qkv_proj.weight, at.qkv_proj.bias, None, None, t.rope_cos, t.rope_sin, pos, widx,
                       past.k, past.v, s=s, row0=0, n_heads=a.n_heads, eps=a.norm_eps)  # [M, Hq * D]
    o = cache_attention(q, past.k, past.v, mask, widx, row0=0)  # [M, Hq * D]
    h1 = linear_residual(o, at.o_proj.weight, x, early_residual=True)  # [M, H]; x: fc's, three kernels back
    u = norm_gate_up(h1, drafter.post_attention_layernorm.weight, mlp.gate_up_proj.weight, a.norm_eps)  # [M, I]
    out = linear_residual(u, mlp.down_proj.weight, h1, early_residual=True)  # [M, H]; h1: two kernels back
    return out.view(b, s, h), past
