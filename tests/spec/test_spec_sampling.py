"""processed_probs / sample: the distribution plain decoding and the verifier share.

Run: python -m pytest tests/spec/test_spec_sampling.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from worker.tlt.decoding.sampling import (
    RowSampling,
    processed_probs,
    sample,
    sample_without_replacement,
    token_logprobs,
)
from worker.tlt.speculative.verify.stat_tests import chi2_sf, chi_square_pvalue, joint_pair_pvalue


def reference_probs(logits: list[float], temperature: float, top_p: float, top_k: int) -> list[float]:
    """Plain-Python restatement of the documented rule for one row."""
    v = len(logits)
    if temperature == 0:
        best = max(range(v), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(v)]
    z = [x / temperature for x in logits]
    if 0 < top_k < v:
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [x if x >= kth else -math.inf for x in z]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    s = sum(e)
    p = [x / s for x in e]
    if top_p < 1:
        order = sorted(range(v), key=lambda i: -p[i])
        keep, mass = set(), 0.0
        for i in order:
            if mass >= top_p:
                break
            keep.add(i)
            mass += p[i]
        p = [p[i] if i in keep else 0.0 for i in range(v)]
        s = sum(p)
        p = [x / s for x in p]
    return p


SETTINGS = [(1.0, 1.0, 0), (0.7, 0.8, 0), (1.3, 1.0, 4), (0.5, 0.9, 3), (0.0, 1.0, 0), (2.0, 0.3, 0)]


@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_processed_probs_matches_reference(temperature: float, top_p: float, top_k: int) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 3, 11, generator=g) * 2  # [B, N, V]
    got = processed_probs(logits, temperature, top_p, top_k)
    assert torch.allclose(got.sum(-1), torch.ones(6, 3))
    for b in range(6):
        for n in range(3):
            ref = reference_probs(logits[b, n].tolist(), temperature, top_p, top_k)
            assert torch.allclose(got[b, n], torch.tensor(ref), atol=1e-5), (b, n)


def test_per_row_tensors_equal_scalar_settings() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(len(SETTINGS), 4, 9, generator=g)
    params = RowSampling(
        temperature=torch.tensor([s[0] for s in SETTINGS]),
        top_p=torch.tensor([s[1] for s in SETTINGS]),
        top_k=torch.tensor([s[2] for s in SETTINGS]),
    )
    mixed = params.probs(logits)
    for b, (t, p, k) in enumerate(SETTINGS):
        assert torch.allclose(mixed[b], processed_probs(logits[b : b + 1], t, p, k)[0], atol=1e-6)
    assert torch.equal(params.select(torch.tensor([4])).temperature, torch.tensor([0.0]))


def test_greedy_is_one_hot_at_first_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert processed_probs(logits, 0.0).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert sample(processed_probs(logits, 0.0)).tolist() == [1]


def test_sample_follows_probs_chi_square() -> None:
    g = torch.Generator().manual_seed(3)
    probs = processed_probs(torch.randn(12, generator=g), 0.9, 0.95, 0)
    draws = sample(probs.expand(100_000, 12), generator=g)
    pv = chi_square_pvalue(torch.bincount(draws, minlength=12), probs)
    assert pv > 1e-4
    # and a wrong distribution is rejected by the same statistic
    wrong = torch.roll(probs, 1)
    assert chi_square_pvalue(torch.bincount(draws, minlength=12), wrong) < 1e-6


def test_sample_never_draws_zero_probability_tokens() -> None:
    probs = torch.zeros(5000, 7)
    probs[:, 2] = 0.3
    probs[:, 5] = 0.7
    assert set(sample(probs).tolist()) <= {2, 5}


def test_token_logprobs() -> None:
    probs = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    lp = token_logprobs(probs, torch.tensor([1, 1]))
    assert math.isclose(float(lp[0]), math.log(0.75), rel_tol=1e-6) and lp[1] == -math.inf


def test_chi2_sf_matches_scipy() -> None:
    from scipy import stats  # a dev dependency

    for x, k in [(3.0, 1), (10.0, 5), (120.0, 99), (0.5, 7), (200.0, 50), (400.0, 143)]:
        assert math.isclose(chi2_sf(x, k), float(stats.chi2.sf(x, k)), rel_tol=1e-5)


def test_sample_without_replacement_is_sequential_draws() -> None:
    """Pairs (first, second) follow q(a) * q(b) / (1 - q(a)), the law of two sequential draws without replacement."""
    g = torch.Generator().manual_seed(4)
    q = torch.softmax(torch.randn(6, generator=g), -1)
    draws = sample_without_replacement(q.expand(100_000, 6), 2, g)
    assert (draws[:, 0] != draws[:, 1]).all()
    second_given_first = (q.unsqueeze(0) * (1 - torch.eye(6))) / (1 - q).unsqueeze(1)
    pv = joint_pair_pvalue(draws[:, 0], draws[:, 1], q, second_given_first)
    assert pv > 1e-5
    # i.i.d. draws (with replacement) are told apart by the same statistic
    iid = sample(q.expand(100_000, 2, 6), g)
    assert joint_pair_pvalue(iid[:, 0], iid[:, 1], q, second_given_first) < 1e-6


def test_scalar_top_k_fast_path_equals_per_row_path_including_ties():
    """A scalar k takes the topk fast path, a [B] tensor the sort path: same distribution, ties at the k-th kept."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 300, generator=gen)
    logits[0, 0, :8] = 4.0  # eight-way tie at the top
    for k in (1, 5, 50, 299):
        fast = processed_probs(logits, 0.7, 1.0, k)
        slow = processed_probs(logits, 0.7, 1.0, torch.full((4,), k))
        torch.testing.assert_close(fast, slow, atol=1e-6, rtol=0)
    assert int((processed_probs(logits, 1.0, 1.0, 5)[0, 0] > 0).sum()) == 8
