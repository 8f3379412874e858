"""The parallel launch configs of the fused kernels (Triton's interpreter on CPU, fp32): qkv_rope in tiles of 16 / 32
output rows matches whole heads to the last ulp (bit-identity: the GPU tests) and torch; split attention (config.split: column chunks merged
by the last split to finish) matches SDPA for ragged rows and tree masks straddling chunk boundaries, gives exactly
the unsplit result where a row fits one chunk, leaves every arrival counter at 0, and keeps a row's output
bit-identical alone (narrower mask, fewer split programs) and inside a batch.
Run: python -m pytest tests/kernels/test_kernels_split.py -q"""

from __future__ import annotations

from typing import cast

import pytest
import torch

from tests.kernels.cases import T, random_cache, tree_batch
from tests.kernels.test_kernels_layer import ATOL, _ref_attention
from worker.tlt.kernels.attention import _COUNTERS, cache_attention
from worker.tlt.kernels.common import Config, default_config
from worker.tlt.kernels.qkv_rope import qkv_rope_cache
from worker.tlt.model.transformer import DecoderLayer, Transformer, apply_rope
from worker.tlt.rollout.reference import tiny_target

WHOLE = Config(block_n=0, block_k=32, num_warps=4, num_stages=2)  # block_n 0: one head per program


def _model(arch: str, head_dim: int) -> Transformer:
    """A tiny model whose heads are wider than 16 rows (the tiny presets' 16 is already a single tile)."""
    return tiny_target(arch, 1, head_dim=head_dim).eval()


@pytest.mark.parametrize(("arch", "head_dim"), [("tiny-llama", 64), ("tiny-qwen2", 32)])
def test_qkv_tiles_equal_whole_heads(arch: str, head_dim: int) -> None:
    model = _model(arch, head_dim)
    a, layer = model.args, cast(DecoderLayer, model.model.layers[0])
    att = layer.self_attn
    bt = tree_batch([3, 40], [-1, 0, 0], T, seed=4)
    b, s = bt.pos.shape
    pos, widx = bt.pos.reshape(-1), bt.widx.reshape(-1)
    x = torch.randn(b * s, a.dim, generator=torch.Generator().manual_seed(0))
    results = []
    for block_n in (0, 16, 32):
        cache = random_cache(model, slots=3, seed=1)
        q = qkv_rope_cache(x, layer.input_layernorm.weight, att.qkv_proj.weight, att.qkv_proj.bias, None, None,
                           model.rope_cos, model.rope_sin, pos, widx, cache.k[0], cache.v[0], s=s, row0=1,
                           n_heads=a.n_heads, eps=a.norm_eps, config=Config(block_n, 32, 4, 2))
        results.append((q, cache.k[0], cache.v[0]))
    for tiled in results[1:]:  # the same dot products in the same K order, only fewer rows per program; but the
        # interpreter's tl.dot is a numpy matmul whose BLAS bits depend on the tile width (a last-ulp difference):
        # bit-identity is checked compiled, tests/kernels/test_kernels_gpu.py
        for t, w in zip(tiled, results[0], strict=True):
            torch.testing.assert_close(t, w, atol=1e-6, rtol=0)
    with torch.no_grad():
        qkv = att.qkv_proj(layer.input_layernorm(x)).view(b * s, -1, a.hd)
        cos, sin = model.rope_cos[pos][:, None], model.rope_sin[pos][:, None]
        want_q = apply_rope(qkv[:, :a.n_heads], cos, sin).reshape(b * s, -1)
    torch.testing.assert_close(results[1][0], want_q, atol=ATOL, rtol=0)


def _counters_zero() -> bool:
    return all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


# rows: 0 columns (own nodes only), 9 (fits one chunk), 62 (its 4 tree nodes straddle the 64 boundary), 150
LENS, ROW0, TK, PARENTS = [0, 9, 62, 150], 1, 160, [-1, 0, 1, 1]


def _setup() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    model = tiny_target("tiny-llama", 1).eval()  # G = 2
    bt = tree_batch(LENS, PARENTS, TK, seed=7)
    cache = random_cache(model, slots=5, seed=2, t=TK)
    q = torch.randn(bt.pos.numel(), model.args.n_heads * model.args.hd, generator=torch.Generator().manual_seed(3))
    return q, cache.k[0], cache.v[0], bt.mask, bt.widx.reshape(-1)


def test_split_attention_matches_sdpa_and_unsplit() -> None:
    q, ck, cv, mask, widx = _setup()
    ref = _ref_attention(q, ck, cv, mask, ROW0, q.shape[1] // ck.shape[3])
    unsplit = cache_attention(q, ck, cv, mask, widx, row0=ROW0, config=Config(32, 0, 4, 2, split=0))
    for split in (32, 48):  # several chunks per long row (48: chunks not a multiple of the 32-column block)
        out = cache_attention(q, ck, cv, mask, widx, row0=ROW0, config=Config(32, 0, 4, 2, split=split))
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
        assert _counters_zero(), split
        fits = (widx + 1 <= split).nonzero().flatten()  # rows of one chunk: the unsplit kernel's very result
        assert len(fits) >= 4 and torch.equal(out[fits], unsplit[fits])
    one = cache_attention(q, ck, cv, mask, widx, row0=ROW0, config=Config(32, 0, 4, 2, split=512))
    assert torch.equal(one, unsplit)  # a single chunk: exactly today's kernel


def test_split_attention_rows_batch_invariant() -> None:
    """Each row alone, with a mask only as wide as it needs (fewer split programs), equals its row in the batch."""
    q, ck, cv, mask, widx = _setup()
    cfg = Config(32, 0, 4, 2, split=64)
    full = cache_attention(q, ck, cv, mask, widx, row0=ROW0, config=cfg)
    s = len(PARENTS)
    for r in (2, 3):  # the straddling row and the longest
        rows = slice(r * s, (r + 1) * s)
        tk = int(widx[rows].max()) + 1
        alone = cache_attention(q[rows], ck, cv, mask[r:r + 1, :, :tk].contiguous(), widx[rows], row0=ROW0 + r,
                                config=cfg)
        assert torch.equal(alone, full[rows]), r
    assert _counters_zero()


def test_default_configs_split_for_one_token() -> None:
    """What the defaults promise SmolLM2 at 1 token (the GPU sweep may tune otherwise): 16-row qkv tiles, 64-column
    attention chunks; old tuned files (no split field) load as unsplit."""
    assert default_config("qkv_rope", 960, 576).block_n == 16
    att = default_config("attention", 3, 64)
    assert att.split == 64 and att.split % att.block_n == 0
    assert Config(128, 64, 4, 2).split == 0
