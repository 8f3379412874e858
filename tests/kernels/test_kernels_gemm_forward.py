"""The large-model cached forward (cuBLAS GEMMs + kernels/glue.py + cache attention) equals
`Transformer.forward_hidden` in fp32 (logits, final hidden, captured layer inputs, K/V written) for decode and tree
verify at every tiny family and at real head shapes; the fused entry routes models of large layers to it; and KernelConfig.gemm_pad_rows runs each GEMM at one fixed M.
Triton's interpreter on CPU (bf16 rounding, batch invariance and the engine: test_gemm_forward_gpu.py). Run: python -m pytest tests/kernels/test_kernels_gemm_forward.py -q"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.cases import REAL_HEADS, clone_cache, decode_batch, model_of, random_cache, tree_batch
from worker.tlt.kernels import forward, gemm_forward
from worker.tlt.kernels.gemm_forward import gemm_forward_hidden
from worker.tlt.kernels.settings import KernelConfig, configure
from worker.tlt.model.load import random_model

ATOL = 2e-5


def _check(model, bt, t, logits_at=None, row0=0):  # type: ignore[no-untyped-def]
    rows = slice(row0, row0 + bt.ids.shape[0])
    ref_cache = random_cache(model, slots=row0 + bt.ids.shape[0], seed=3, t=t)
    cache = clone_cache(ref_cache)
    kw = dict(cache_rows=rows, write_idx=bt.widx, attn_mask=bt.mask, logits_at=logits_at, layers=(0, 1))
    with torch.no_grad():
        ref = model.forward_hidden(bt.ids, bt.pos, ref_cache, **kw)
    out = gemm_forward_hidden(model, bt.ids, bt.pos, cache, **kw)
    for got, want in ((out[0], ref[0]), (out[1], ref[1]), (out[2][0], ref[2][0]), (out[2][1], ref[2][1])):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert out[2].keys() == {0, 1}
    for new, want in zip((*cache.k, *cache.v), (*ref_cache.k, *ref_cache.v), strict=True):
        torch.testing.assert_close(new, want, atol=ATOL, rtol=0)


# GQA with plain heads, and q/k norm; biases and RoPE scaling come with the real-head configs below
@pytest.mark.parametrize("name", ["llama-g2", "qwen3"])
@pytest.mark.parametrize("kind", ["decode", "tree"])
def test_gemm_forward_equals_torch(name: str, kind: str) -> None:
    lens, t = [5, 131, 12], 160
    bt = decode_batch(lens, t, seed=2) if kind == "decode" else tree_batch(lens, [-1, 0, 1, 0, 3], t, seed=2)
    _check(model_of(name), bt, t, logits_at=None if kind == "decode" else torch.tensor([[0, 2, 4]] * 3), row0=1)


@pytest.mark.parametrize("name", list(REAL_HEADS))
def test_gemm_forward_chain_verify_at_real_heads(name: str) -> None:
    model = random_model(REAL_HEADS[name], seed=2, std=0.05)
    _check(model, tree_batch([3, 21], [-1, 0, 1, 2, 3, 4, 5, 6], 40, seed=1), 40)


def test_models_over_the_limit_take_this_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_of("qwen2")
    assert forward.cached_forward(model).func is forward.fused_forward_hidden  # type: ignore[attr-defined]
    monkeypatch.setattr(gemm_forward, "GEMM_LAYER_BYTES", 0)  # every model counts as large
    chosen = forward.cached_forward(model)
    assert chosen.func is gemm_forward_hidden and chosen.args == (model,)  # type: ignore[attr-defined]


def test_pad_rows_runs_every_gemm_at_one_m(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_of("qwen3")
    bt = decode_batch([4, 9, 2], 40, seed=1)
    seen: list[int] = []
    cublas = F.linear

    def recording_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(x.shape[0])
        return cublas(x, w, b)

    monkeypatch.setattr(gemm_forward.F, "linear", recording_linear)
    previous = configure(KernelConfig(gemm_pad_rows=16))
    try:
        padded = gemm_forward_hidden(model, bt.ids, bt.pos, random_cache(model, 3, seed=1, t=40), attn_mask=bt.mask)
    finally:
        configure(previous)
    assert seen and set(seen) == {16}  # 3 rows in, 16 through cuBLAS: the pad rows are zeros, dropped after
    seen.clear()
    plain = gemm_forward_hidden(model, bt.ids, bt.pos, random_cache(model, 3, seed=1, t=40), attn_mask=bt.mask)
    assert set(seen) == {3}
    torch.testing.assert_close(padded[0], plain[0], atol=ATOL, rtol=0)
