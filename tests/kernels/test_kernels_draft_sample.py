"""kernels/draft_sample.py against the torch path of a chain draft's sampling step (processed_probs + the
exponential race of decoding/sampling.sample), for the same noise: the same token, and q equal to the processed
distribution; on several chunks with a ragged last one, bf16 and fp32 logits, -inf columns (an EAGLE-3 draft
vocabulary's holes); with a draft vocabulary map, the token as a target id and q scattered into the target's
vocabulary (zeros elsewhere). Triton's interpreter on CPU (tests/conftest.py); the `gpu` case runs compiled at SmolLM2's
vocabulary. Run: python -m pytest tests/kernels/test_kernels_draft_sample.py -q"""

from __future__ import annotations

import os

import pytest
import torch

from worker.tlt.decoding.sampling import pick_with_noise, processed_probs
from worker.tlt.kernels.draft_sample import draft_sample


def _case(b: int, v: int, seed: int, dtype: torch.dtype, holes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(b, v, generator=g)).to(dtype)
    if holes:
        logits[:, 7::5] = float("-inf")
    return logits, torch.empty(b, v).exponential_(generator=g)


def _check(logits: torch.Tensor, noise: torch.Tensor, temp: float, chunk: int | None = None) -> None:
    kw = {} if chunk is None else {"chunk": chunk}
    tok, q = draft_sample(logits, noise, temp, **kw)
    want_q = processed_probs(logits.float(), temp)
    assert torch.equal(tok, pick_with_noise(want_q, noise))
    torch.testing.assert_close(q, want_q, rtol=2e-5, atol=1e-7)
    assert torch.all(q[logits == float("-inf")] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,v,temp", [(1, 1000, 1.0), (3, 700, 0.7)])
def test_draft_sample_equals_torch_path(dtype: torch.dtype, b: int, v: int, temp: float) -> None:
    for seed in range(3):
        _check(*_case(b, v, seed, dtype, holes=seed == 2), temp, chunk=256)  # 3-4 chunks, the last ragged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_vocab_maps_tokens_and_scatters_q(dtype: torch.dtype) -> None:
    """Logits over V' = 300 draft ids of a 1000-token vocabulary: token and q in target ids, written into `out`."""
    b, vd, v = 3, 300, 1000
    vocab = torch.sort(torch.randperm(v, generator=torch.Generator().manual_seed(0))[:vd]).values
    for seed in range(3):
        logits, noise = _case(b, vd, seed, dtype)
        out = torch.zeros(b + 1, v)[1:]  # a row-strided view, as a draft_probs slice
        tok, q = draft_sample(logits, noise, 0.8, vocab=vocab, out=out, chunk=128)
        want_q = processed_probs(logits.float(), 0.8)
        assert q.data_ptr() == out.data_ptr()
        assert torch.equal(tok, vocab[pick_with_noise(want_q, noise)])
        torch.testing.assert_close(q[:, vocab], want_q, rtol=2e-5, atol=1e-7)
        outside = torch.ones(v, dtype=torch.bool)
        outside[vocab] = False
        assert torch.all(q[:, outside] == 0)


def test_draft_sample_refuses_greedy_and_bad_noise() -> None:
    logits, noise = _case(2, 64, 0, torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        draft_sample(logits, noise, 0.0)
    with pytest.raises(ValueError, match="noise"):
        draft_sample(logits, noise[:, :32], 1.0)
    with pytest.raises(ValueError, match="vocab"):
        draft_sample(logits, noise, 1.0, vocab=torch.arange(32))
    with pytest.raises(ValueError, match="out"):
        draft_sample(logits, noise, 1.0, vocab=torch.arange(64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run compiled, alone with -m gpu")
@pytest.mark.parametrize("b", [1, 8])
def test_gpu_smollm2_vocab(b: int) -> None:
    for seed in range(10):
        logits, noise = _case(b, 49152, seed, torch.bfloat16)
        _check(logits.cuda(), noise.cuda(), 1.0)
