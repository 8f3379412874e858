"""The whole fused cached forward equals `Transformer.forward_hidden` in fp32 (logits, final hidden, captured layer
inputs, every K/V written into the cache) for decode (ragged rows) and tree verify (S > 1, logits_at), with a
cache_rows offset; and a row's logits are bit-identical alone and inside a batch of 5.
Run: python -m pytest tests/kernels/test_kernels_forward.py -q"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import ARCHS, Batch, T, clone_cache, decode_batch, model_of, random_cache, tree_batch
from worker.tlt.kernels.forward import fused_forward_hidden

ATOL = 2e-5


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("kind", ["decode", "tree"])
def test_fused_forward_equals_torch(name: str, kind: str) -> None:
    model = model_of(name)
    lens, row0, t = [5, 231, 12], 1, 260  # row 1 walks 4 column blocks
    bt = decode_batch(lens, t, seed=2) if kind == "decode" else tree_batch(lens, [-1, 0, 1, 0, 3], t, seed=2)
    logits_at = None if kind == "decode" else torch.tensor([[0, 2, 4]] * 3)
    rows = slice(row0, row0 + len(lens))
    ref_cache = random_cache(model, slots=5, seed=3, t=t)
    cache = clone_cache(ref_cache)
    kw = dict(cache_rows=rows, write_idx=bt.widx, attn_mask=bt.mask, logits_at=logits_at, layers=(0, 1))
    with torch.no_grad():
        ref = model.forward_hidden(bt.ids, bt.pos, ref_cache, **kw)  # type: ignore[arg-type]
    out = fused_forward_hidden(model, bt.ids, bt.pos, cache, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(out[0], ref[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], ref[1], atol=ATOL, rtol=0)
    assert out[2].keys() == ref[2].keys() == {0, 1}
    for i in (0, 1):
        torch.testing.assert_close(out[2][i], ref[2][i], atol=ATOL, rtol=0)
    for new, want in zip((*cache.k, *cache.v), (*ref_cache.k, *ref_cache.v), strict=True):
        torch.testing.assert_close(new, want, atol=ATOL, rtol=0)


def test_fused_forward_without_logits() -> None:
    model = model_of("llama-g2")
    bt = decode_batch([4, 9], T, seed=1)
    logits, hidden, _ = fused_forward_hidden(model, bt.ids, bt.pos, random_cache(model, 2, seed=1),
                                             attn_mask=bt.mask, compute_logits=False)
    assert logits.numel() == 0 and hidden.shape == (2, 1, model.args.dim)


def _row(bt: Batch, r: int) -> Batch:
    return Batch(bt.ids[r:r + 1], bt.pos[r:r + 1], bt.widx[r:r + 1], bt.mask[r:r + 1])


@pytest.mark.parametrize("kind", ["decode", "tree"])
def test_batch_invariance(kind: str) -> None:
    """Row 0 alone (mask width 160) gives the very same logits as inside a batch of 5 (mask width 300), and the
    other rows' contents do not move it by a bit. (Row 0 only: Triton's CPU interpreter runs tl.dot as a numpy
    matmul, whose BLAS result depends on a row's position inside the 16-row tile; on the GPU the MMA does not, and
    tests/kernels/test_kernels_gpu.py checks every row.)"""
    model = model_of("qwen3")
    t = 300
    lens = [140, 20, 7, 241, 11]
    parents = [-1, 0, 0, 2]
    batch = decode_batch if kind == "decode" else (lambda ls, tk, seed: tree_batch(ls, parents, tk, seed))
    bt = batch(lens, t, 5)
    base = random_cache(model, slots=5, seed=6, t=t)
    full, _, _ = fused_forward_hidden(model, bt.ids, bt.pos, clone_cache(base), write_idx=bt.widx,
                                      attn_mask=bt.mask)
    one = _row(bt, 0)
    alone, _, _ = fused_forward_hidden(model, one.ids, one.pos, clone_cache(base), cache_rows=slice(0, 1),
                                       write_idx=one.widx, attn_mask=one.mask[:, :, :160].contiguous())
    assert torch.equal(alone[0], full[0])
    # other rows: other lengths, tokens and cache contents
    bt2 = batch([140, 9, 233, 2, 50], t, 9)
    bt2.ids[0], bt2.pos[0], bt2.widx[0], bt2.mask[0] = bt.ids[0], bt.pos[0], bt.widx[0], bt.mask[0]
    other = random_cache(model, slots=5, seed=11, t=t)
    for mine, theirs in zip((*other.k, *other.v), (*base.k, *base.v), strict=True):
        mine[0] = theirs[0]
    full2, _, _ = fused_forward_hidden(model, bt2.ids, bt2.pos, other, write_idx=bt2.widx, attn_mask=bt2.mask)
    assert torch.equal(full2[0], full[0])
    assert not torch.equal(full2[1], full[1])
