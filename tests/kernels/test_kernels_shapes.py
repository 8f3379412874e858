"""The fused cached forward at real head shapes (head_dim 128; GQA groups of 7, 4 and 8; Qwen2 biases, Llama-3 RoPE
scaling, Qwen3 q/k norm) equals `Transformer.forward_hidden` in fp32 for a chain verify of 8 tokens per ragged row,
K/V written included; and the chain's root logits equal a 1-token decode of the same rows (bit for bit for the first
row, see below: the kernels' result for a row does not depend on the tokens beside it, so greedy SD stays
token-identical). Triton's interpreter on CPU. Run: python -m pytest tests/kernels/test_kernels_shapes.py -q"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import REAL_HEADS, clone_cache, random_cache, tree_batch
from worker.tlt.kernels.forward import fused_forward_hidden
from worker.tlt.model.load import random_model

T = 40
CHAIN = [-1, 0, 1, 2, 3, 4, 5, 6]  # root + 7 drafts


@pytest.mark.parametrize("name", list(REAL_HEADS))
def test_fused_verify_equals_torch_and_decode_at_real_heads(name: str) -> None:
    model = random_model(REAL_HEADS[name], seed=2, std=0.05)
    bt = tree_batch([3, 21], CHAIN, T, seed=1)
    ref_cache = random_cache(model, slots=2, seed=3, t=T)
    cache = clone_cache(ref_cache)
    with torch.no_grad():
        ref = model.forward_hidden(bt.ids, bt.pos, ref_cache, write_idx=bt.widx, attn_mask=bt.mask)
    out = fused_forward_hidden(model, bt.ids, bt.pos, cache, write_idx=bt.widx, attn_mask=bt.mask)
    torch.testing.assert_close(out[0], ref[0], atol=2e-5, rtol=0)
    for new, want in zip((*cache.k, *cache.v), (*ref_cache.k, *ref_cache.v), strict=True):
        torch.testing.assert_close(new, want, atol=2e-5, rtol=0)
    root = slice(0, 1)  # the chain's root of each row, decoded alone
    dec = fused_forward_hidden(model, bt.ids[:, root], bt.pos[:, root], clone_cache(ref_cache),
                               write_idx=bt.widx[:, root], attn_mask=bt.mask[:, root].contiguous())
    # bit for bit where the root sits at the same row of the 16-row tile in both calls (row 0): Triton's CPU
    # interpreter runs tl.dot as a numpy matmul, whose BLAS result may depend on a row's position in the tile (on the
    # GPU the MMA does not: tests/kernels/test_kernels_gpu.py checks every row); the other rows to fp32 rounding
    assert torch.equal(dec[0][0, 0], out[0][0, 0])
    torch.testing.assert_close(dec[0][:, 0], out[0][:, 0], atol=1e-5, rtol=0)
