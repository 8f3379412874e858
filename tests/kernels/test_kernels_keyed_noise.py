"""kernels/keyed_noise.py: the per-sequence streams' Exp(1) noise in one Triton kernel computes the torch version's
hash (a wrong bit anywhere would give an unrelated value) and its float result up to the float32 log (2e-6 relative),
whatever the keys (sign bit set, zero, extremes), positions and widths (a ragged last block). Triton's interpreter on
CPU; the `gpu` case runs compiled at a real vocabulary.
Run: python -m pytest tests/kernels/test_kernels_keyed_noise.py -q"""

from __future__ import annotations

import pytest
import torch

from worker.tlt.decoding import streams
from worker.tlt.kernels import keyed_noise


def _check(device: str, vocab: int) -> None:
    keys = torch.tensor([streams.sequence_key(3, i) for i in range(5)] + [-(2**63), 0, 2**63 - 1], device=device)
    pos = torch.arange(8, device=device) * 7
    got = keyed_noise.row_exponentials(keys, pos, streams.SAMPLE, vocab)
    want = streams.row_exponentials(keys, pos, streams.SAMPLE, vocab)
    assert got.shape == want.shape == (8, vocab) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0.0)
    draft = keyed_noise.row_exponentials(keys, pos + 2, streams.DRAFT, vocab)
    torch.testing.assert_close(draft, streams.row_exponentials(keys, pos + 2, streams.DRAFT, vocab), rtol=2e-6, atol=0.0)


@pytest.mark.parametrize("vocab", [1, 1000, 2500])
def test_kernel_equals_torch_streams(vocab: int) -> None:
    _check("cpu", vocab)


def test_the_samplers_use_the_kernel_only_where_it_agrees_with_the_torch_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    keys, pos = torch.tensor([streams.sequence_key(1, 0)]), torch.tensor([4])
    want = streams.row_exponentials(keys, pos, streams.SAMPLE, 50)
    assert keyed_noise.agrees_on(torch.device("cpu"))  # the interpreter computes the hash exactly
    wrong = lambda k, p, purpose, n: torch.zeros(k.shape[0], n)  # noqa: E731 - a mistranslating compiler
    monkeypatch.setattr(keyed_noise, "row_exponentials", wrong)
    keyed_noise.agrees_on.cache_clear()
    try:
        assert not keyed_noise.agrees_on(torch.device("cpu"))
        torch.testing.assert_close(keyed_noise.stream_exponentials(keys, pos, streams.SAMPLE, 50), want)
    finally:
        keyed_noise.agrees_on.cache_clear()


def test_empty_batch() -> None:
    assert keyed_noise.keyed_exponentials(torch.zeros(0, dtype=torch.int64), 5).shape == (0, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_equals_torch_streams_compiled() -> None:
    _check("cuda", 151_936)
