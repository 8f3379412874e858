"""Which kernels a call takes: a model over LARGE_MODEL_BYTES runs the torch forward for calls of more than
LARGE_MODEL_MAX_SEQS sequences (bit-equal to model.forward_hidden, decode and verify of one batch on the same side)
and the fused kernels below; the default launch rule prefetches weight rows only for matrices that fit the L2
budget. Run: python -m pytest tests/kernels/test_kernels_routing.py -q"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cases import decode_batch, model_of, random_cache
from worker.tlt.kernels import forward
from worker.tlt.kernels.common import PREFETCH_MAX_BYTES, default_config
from worker.tlt.kernels.tuning import candidates


def _run(model, lens: list[int], t: int = 40):  # type: ignore[no-untyped-def]
    bt = decode_batch(lens, t, seed=4)
    cache = random_cache(model, slots=len(lens), seed=5, t=t)
    with torch.no_grad():
        ref = model.forward_hidden(bt.ids, bt.pos, random_cache(model, slots=len(lens), seed=5, t=t),
                                   write_idx=bt.widx, attn_mask=bt.mask)
    out = forward.fused_forward_hidden(model, bt.ids, bt.pos, cache, write_idx=bt.widx, attn_mask=bt.mask)
    return out[0], ref[0]


def test_large_models_take_torch_above_the_sequence_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_of("llama-g2")
    monkeypatch.setattr(forward, "LARGE_MODEL_BYTES", 0)  # every model counts as large
    monkeypatch.setattr(forward, "LARGE_MODEL_MAX_SEQS", 2)
    def no_kernels(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("fused kernel launched")

    monkeypatch.setattr(forward, "qkv_rope_cache", no_kernels)
    got, want = _run(model, [3, 7, 5])  # 3 sequences > 2: torch, exactly
    assert torch.equal(got, want)
    with pytest.raises(AssertionError, match="fused kernel launched"):
        _run(model, [3, 7])  # 2 sequences: the fused kernels


def test_small_models_stay_fused_at_any_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forward, "LARGE_MODEL_MAX_SEQS", 1)
    got, want = _run(model_of("qwen2"), [3, 7, 5])  # a tiny model is far below LARGE_MODEL_BYTES
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_prefetch_only_for_matrices_that_fit_the_budget() -> None:
    assert default_config("linear_residual", 576, 1536).prefetch  # SmolLM2's down
    assert default_config("linear_residual", 3584, 3584).prefetch  # Qwen2.5-7B's o_proj: 26 MB
    assert not default_config("norm_gate_up", 18944, 3584).prefetch  # its gate|up: 272 MB
    assert not default_config("linear_residual", 3584, 18944).prefetch
    half = PREFETCH_MAX_BYTES // 4  # bf16 elements of half the budget
    assert default_config("norm_gate_up", half // 1024, 1024).prefetch
    assert not default_config("norm_gate_up", 2 * half // 1024, 1024).prefetch
    cands = candidates("norm_gate_up", 18944, 3584)  # the rule's choice everywhere but one: the other choice
    assert [c.prefetch for c in cands].count(True) == 1
