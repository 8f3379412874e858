"""Each fused kernel against its torch reference in fp32 (Triton's interpreter on CPU): the qkv+RoPE+cache-write
kernel (Llama G=2 / G=1, Qwen2 bias, Qwen3 q/k norm; ragged positions, S>1, a cache_rows offset), attention over
the cache with ragged rows and tree masks (and with a non-default config), o_proj / down_proj + residual, the
norm+gate|up+SiLU kernel and the head, each also under another launch config than the default.
Run: python -m pytest tests/kernels/test_kernels_layer.py -q"""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.cases import ARCHS, T, model_of, random_cache, tree_batch
from worker.tlt.kernels.attention import cache_attention
from worker.tlt.kernels.common import Config
from worker.tlt.kernels.linear import linear_residual, norm_gate_up
from worker.tlt.kernels.qkv_rope import qkv_rope_cache
from worker.tlt.model.transformer import DecoderLayer, apply_rope

ATOL = 1e-5


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("parents", [[-1], [-1, 0, 0, 1]], ids=["s1", "tree4"])
def test_qkv_rope_writes_cache_and_q(name: str, parents: list[int]) -> None:
    model = model_of(name)
    a, layer = model.args, cast(DecoderLayer, model.model.layers[1])
    att = layer.self_attn
    lens, row0 = [3, 17, 40], 2
    bt = tree_batch(lens, parents, T, seed=4)
    b, s = bt.pos.shape
    x = torch.randn(b * s, a.dim, generator=torch.Generator().manual_seed(0))
    cache = random_cache(model, slots=6, seed=1)
    before = cache.k[1].clone(), cache.v[1].clone()
    pos, widx = bt.pos.reshape(-1), bt.widx.reshape(-1)
    q = qkv_rope_cache(x, layer.input_layernorm.weight, att.qkv_proj.weight, att.qkv_proj.bias,
                       att.q_norm.weight if att.q_norm is not None else None,
                       att.k_norm.weight if att.k_norm is not None else None,
                       model.rope_cos, model.rope_sin, pos, widx, cache.k[1], cache.v[1],
                       s=s, row0=row0, n_heads=a.n_heads, eps=a.norm_eps)
    with torch.no_grad():  # the reference: Attention.forward's steps
        qkv = att.qkv_proj(layer.input_layernorm(x)).view(b * s, -1, a.hd)
        rq, rk, rv = qkv.split((a.n_heads, a.n_kv_heads, a.n_kv_heads), dim=1)
        if att.q_norm is not None and att.k_norm is not None:
            rq, rk = att.q_norm(rq), att.k_norm(rk)
        cos, sin = model.rope_cos[pos][:, None], model.rope_sin[pos][:, None]
        rq, rk = apply_rope(rq, cos, sin), apply_rope(rk, cos, sin)
    torch.testing.assert_close(q, rq.reshape(b * s, -1), atol=ATOL, rtol=0)
    rows = row0 + torch.arange(b * s) // s
    torch.testing.assert_close(cache.k[1][rows, :, widx], rk, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.v[1][rows, :, widx], rv, atol=ATOL, rtol=0)
    # nothing else changed
    for new, old in zip((cache.k[1], cache.v[1]), before, strict=True):
        keep = torch.ones_like(new, dtype=torch.bool)
        keep[rows, :, widx] = False
        assert torch.equal(new[keep], old[keep])


def _ref_attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, mask: torch.Tensor, row0: int,
                   n_heads: int) -> torch.Tensor:
    b, s, tk = mask.shape
    d = ck.shape[-1]
    g = n_heads // ck.shape[1]
    keys = ck[row0:row0 + b, :, :tk].repeat_interleave(g, dim=1)  # [B, Hq, Tk, D]
    vals = cv[row0:row0 + b, :, :tk].repeat_interleave(g, dim=1)
    qh = q.view(b, s, n_heads, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=mask[:, None])
    return out.transpose(1, 2).reshape(b * s, n_heads * d)


@pytest.mark.parametrize("name", ["llama-g2", "llama-g1", "qwen3"])
@pytest.mark.parametrize("parents", [[-1], [-1, 0, 0, 1, 2, 4]], ids=["s1", "tree6"])
def test_attention_matches_sdpa(name: str, parents: list[int]) -> None:
    model = model_of(name)
    a = model.args
    lens, row0, tk = [0, 9, 150, 270], 1, 290  # row 0: an empty prefix (attends its own nodes only)
    bt = tree_batch(lens, parents, tk, seed=7)
    b, s = bt.pos.shape
    cache = random_cache(model, slots=6, seed=2, t=300)
    q = torch.randn(b * s, a.n_heads * a.hd, generator=torch.Generator().manual_seed(3))
    ref = _ref_attention(q, cache.k[0], cache.v[0], bt.mask, row0, a.n_heads)
    for cfg in (None, Config(block_n=32, block_k=0, num_warps=2, num_stages=1)):  # default BLOCK_N 64, then 32
        out = cache_attention(q, cache.k[0], cache.v[0], bt.mask, bt.widx.reshape(-1), row0=row0, config=cfg)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    # o_proj + residual on the attention output
    layer = cast(DecoderLayer, model.model.layers[0])
    x = torch.randn(b * s, a.dim, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = x + layer.self_attn.o_proj(ref)
    torch.testing.assert_close(linear_residual(out, layer.self_attn.o_proj.weight, x), want, atol=ATOL, rtol=0)


def test_attention_ignores_columns_past_its_own() -> None:
    """A token never reads columns right of its write column, whatever the mask says (they are other nodes' K/V).
    Its column (148) sits inside a column block: the walk stops mid-block, and the mask width does not matter."""
    model = model_of("llama-g2")
    t = 384
    cache = random_cache(model, slots=2, seed=5, t=t)
    widx = torch.tensor([148])
    q = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    causal = torch.arange(t)[None, None] <= 148
    full = torch.ones(1, 1, t, dtype=torch.bool)
    a = cache_attention(q, cache.k[0], cache.v[0], full, widx, row0=1)
    b = cache_attention(q, cache.k[0], cache.v[0], causal, widx, row0=1)
    narrow = cache_attention(q, cache.k[0], cache.v[0], causal[:, :, :149].contiguous(), widx, row0=1)
    assert torch.equal(a, b) and torch.equal(a, narrow)
    torch.testing.assert_close(a, _ref_attention(q, cache.k[0], cache.v[0], causal, 1, 4), atol=ATOL, rtol=0)


@pytest.mark.parametrize("m", [1, 5, 19])
def test_projections_with_residual_and_swiglu(m: int) -> None:
    model = model_of("qwen2")
    layer = cast(DecoderLayer, model.model.layers[0])
    g = torch.Generator().manual_seed(m)
    h = torch.randn(m, model.args.dim, generator=g)
    with torch.no_grad():
        ref_u = (lambda gu: F.silu(gu[0]) * gu[1])(layer.mlp.gate_up_proj(layer.post_attention_layernorm(h)).chunk(2, -1))
        ref_x = h + layer.mlp.down_proj(ref_u)
    other = Config(block_n=32, block_k=32, num_warps=2, num_stages=1)  # several K steps, other tiles
    for cfg in (None, other):
        u = norm_gate_up(h, layer.post_attention_layernorm.weight, layer.mlp.gate_up_proj.weight,
                         model.args.norm_eps, config=cfg)
        torch.testing.assert_close(u, ref_u, atol=ATOL, rtol=0)
        torch.testing.assert_close(linear_residual(u, layer.mlp.down_proj.weight, h, config=cfg), ref_x, atol=ATOL,
                                   rtol=0)
        # without a residual: the lm head
        logits = linear_residual(h, model.head_weight, None, config=cfg)
        torch.testing.assert_close(logits, h @ model.head_weight.T, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kt", [24, 32])  # a table width that splits a K tile, and one on a tile boundary
def test_gathered_input_equals_concat(kt: int) -> None:
    """gather=(table, ids): the input is concat(table[ids], a) (an EAGLE-1 drafter's fc over its token embedding
    and the target feature), bit for bit what the kernel computes on the concatenated input."""
    g = torch.Generator().manual_seed(kt)
    m, ka, n = 7, 40, 48
    table, a = torch.randn(50, kt, generator=g), torch.randn(m, ka, generator=g)
    w = torch.randn(n, kt + ka, generator=g)
    ids = torch.randint(0, 50, (m,), generator=g)
    for cfg in (None, Config(block_n=32, block_k=16, num_warps=2, num_stages=1)):
        got = linear_residual(a, w, None, gather=(table, ids), config=cfg)
        assert torch.equal(got, linear_residual(torch.cat([table[ids], a], -1), w, None, config=cfg))
    torch.testing.assert_close(got, torch.cat([table[ids], a], -1) @ w.T, atol=ATOL, rtol=0)


def test_qkv_rope_clamps_positions_into_the_table() -> None:
    """Positions below 0 or past the RoPE table read its first / last row (the drafter's chain passes unclamped
    positions; a kernel must never read outside the table)."""
    model = model_of("llama-g2")
    a, layer = model.args, cast(DecoderLayer, model.model.layers[0])
    att, last = layer.self_attn, model.rope_cos.shape[0] - 1
    x = torch.randn(3, a.dim, generator=torch.Generator().manual_seed(0))
    widx = torch.tensor([0, 1, 2])

    def q_at(pos: list[int]) -> torch.Tensor:
        cache = random_cache(model, slots=2, seed=1)
        return qkv_rope_cache(x, layer.input_layernorm.weight, att.qkv_proj.weight, att.qkv_proj.bias, None, None,
                              model.rope_cos, model.rope_sin, torch.tensor(pos), widx, cache.k[0], cache.v[0],
                              s=3, row0=0, n_heads=a.n_heads, eps=a.norm_eps)

    assert torch.equal(q_at([-5, last + 1, last + 900]), q_at([0, last, last]))
