"""Speculative sampling is exactly lossless: chi-square goodness of fit of emitted tokens against the target.

The target is a Markov (bigram) model over a small vocabulary, so the exact law of the first two emitted tokens is
known: P(x1 | root) * P(x2 | x1), P being the *processed* distribution (temperature / top-p / top-k). Each test
draws 1e5 sequences as one batch, runs one speculative step (and a second one for the rows that emitted a single
token) and tests the joint (x1, x2) counts over V*V bins. The same statistic must reject deliberately wrong rules
(accept with min(1, q/p); resample from p instead of the residual; residual not renormalised) at p < 1e-6, so the
test can fail.

Run: python -m pytest tests/spec/test_spec_verify_lossless.py -q
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from worker.tlt.decoding.draft_types import DraftProposal, VerifyResult
from worker.tlt.decoding.sampling import processed_probs, sample, sample_without_replacement
from worker.tlt.speculative.proposers.draft_tree import chain_proposal
from worker.tlt.speculative.verify import verifier
from worker.tlt.speculative.verify.stat_tests import chi_square_pvalue, joint_pair_pvalue
from worker.tlt.speculative.verify.verifier import verify_sampling

VOCAB = 10
SAMPLES = 100_000
ROOT = 3
TREE = [-1, 0, 0, 0, 1, 1, 2, 4, 4]  # parents of a 9-node tree: 3 children at the root, depth 3
PASS = 1e-5  # a correct rule fails by chance with probability 1e-5 per test; wrong ones land far below 1e-6


class Markov:
    def __init__(self, seed: int, temperature: float, top_p: float, top_k: int) -> None:
        g = torch.Generator().manual_seed(seed)
        raw = torch.randn(VOCAB, VOCAB, generator=g) * 1.5  # target logits of the next token given the previous one
        self.p = processed_probs(raw, temperature, top_p, top_k)  # [V, V]
        # the drafter: correlated with the target (so drafts get accepted) but clearly different from it
        self.q = torch.softmax(0.8 * raw + torch.randn(VOCAB, VOCAB, generator=g), dim=-1)
        self.gen = torch.Generator().manual_seed(seed + 1000)

    def chain(self, roots: torch.Tensor, k: int = 4) -> VerifyResult:  # roots [S]
        x, toks, qs = roots, [], []
        for _ in range(k):
            q = self.q[x]
            x = sample(q, self.gen)
            toks.append(x)
            qs.append(q)
        prop = chain_proposal(roots, torch.stack(toks, 1), torch.stack(qs, 1))
        return verify_sampling(prop, self.p[prop.tokens], self.gen)

    def _tree_tokens(self, roots: torch.Tensor, pick: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        tokens = torch.zeros(roots.shape[0], len(TREE), dtype=torch.int64)
        tokens[:, 0] = roots
        for node in range(len(TREE)):
            kids = [i for i, par in enumerate(TREE) if par == node]
            if kids:
                tokens[:, kids] = pick(tokens[:, node], len(kids))
        return tokens

    def tree(self, roots: torch.Tensor, mode: str) -> VerifyResult:
        s = roots.shape[0]

        def top_m(parent_tok: torch.Tensor, m: int) -> torch.Tensor:  # deterministic top-k tree
            return self.q[parent_tok].topk(m, dim=-1).indices

        def uniform(parent_tok: torch.Tensor, m: int) -> torch.Tensor:  # arbitrary drafts, duplicates allowed
            return torch.randint(0, VOCAB, (parent_tok.shape[0], m), generator=self.gen)

        def without_replacement(parent_tok: torch.Tensor, m: int) -> torch.Tensor:  # sequential draws from q
            return sample_without_replacement(self.q[parent_tok], m, self.gen)

        pick = {"topk": top_m, "uniform": uniform, "stochastic": without_replacement}[mode]
        tokens = self._tree_tokens(roots, pick)
        counts = torch.randint(1, len(TREE) + 1, (s,), generator=self.gen)
        idx = torch.arange(len(TREE))
        parents = torch.where(idx < counts.unsqueeze(1), torch.tensor(TREE), -1)
        draft_probs = self.q[tokens] if mode == "stochastic" else None
        prop = DraftProposal(tokens=tokens, parents=parents, counts=counts, draft_probs=draft_probs)
        return verify_sampling(prop, self.p[tokens], self.gen)

    def two_tokens_pvalue(self, step: Callable[[torch.Tensor], VerifyResult]) -> tuple[float, float]:
        """(p-value of the joint law of the first two emitted tokens, mean emitted per first step)."""
        res = step(torch.full((SAMPLES,), ROOT, dtype=torch.int64))
        first = res.tokens[:, 0]
        second = res.tokens[:, 1].clone()
        need = res.num_emitted == 1
        second[need] = step(first[need]).tokens[:, 0]
        pv = joint_pair_pvalue(first, second, self.p[ROOT], self.p)
        return pv, float(res.num_emitted.float().mean())


SETTINGS = [(1.0, 1.0, 0), (0.6, 0.85, 0), (1.4, 1.0, 4), (0.8, 0.9, 5), (0.0, 1.0, 0)]


@pytest.mark.parametrize("temperature,top_p,top_k", SETTINGS)
def test_chain_with_draft_probs_is_lossless(temperature: float, top_p: float, top_k: int) -> None:
    m = Markov(11, temperature, top_p, top_k)
    pv, mean_emitted = m.two_tokens_pvalue(m.chain)
    assert pv > PASS, pv
    assert mean_emitted > 1.2  # drafts do get accepted, so the accept path is what is being tested


TREE_CASES = [
    ("topk", *SETTINGS[0]),
    ("topk", *SETTINGS[1]),
    ("topk", *SETTINGS[2]),
    ("uniform", *SETTINGS[2]),
    ("stochastic", *SETTINGS[0]),
    ("stochastic", *SETTINGS[1]),
]


@pytest.mark.parametrize("mode,temperature,top_p,top_k", TREE_CASES)
def test_tree_is_lossless(mode: str, temperature: float, top_p: float, top_k: int) -> None:
    m = Markov(14, temperature, top_p, top_k)
    pv, mean_emitted = m.two_tokens_pvalue(lambda r: m.tree(r, mode))
    assert pv > PASS, pv
    assert mean_emitted > 1.2


def _wrong_accept(u: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    return u * p_x < q_x  # min(1, q/p): the ratio upside down


def _no_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p  # resample from the target itself after a rejection


def _unnormalised_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p - q).clamp_min(0.0)  # max(0, p - q) without renormalising


@pytest.mark.parametrize(
    "patch,target,draft",
    [
        ("_accept", _wrong_accept, "chain"),
        ("_accept", _wrong_accept, "topk"),
        ("_residual", _no_residual, "chain"),
        ("_residual", _no_residual, "topk"),
        ("_residual", _unnormalised_residual, "topk"),
        ("_residual", _unnormalised_residual, "stochastic"),
    ],
)
def test_wrong_rules_are_rejected(monkeypatch: pytest.MonkeyPatch, patch: str, target: Callable, draft: str) -> None:
    monkeypatch.setattr(verifier, patch, target)
    m = Markov(13, 1.0, 1.0, 0)
    step = m.chain if draft == "chain" else (lambda r: m.tree(r, draft))
    pv, _ = m.two_tokens_pvalue(step)
    assert pv < 1e-6, pv


def test_mixed_settings_in_one_batch() -> None:
    """Half the rows greedy, half sampled at T=1 with top-p: each half follows its own processed distribution."""
    g = torch.Generator().manual_seed(21)
    raw = torch.randn(VOCAB, VOCAB, generator=g) * 1.5
    q_table = torch.softmax(0.8 * raw + torch.randn(VOCAB, VOCAB, generator=g), dim=-1)
    s = SAMPLES
    greedy_rows = torch.arange(s) % 2 == 0
    temp = torch.where(greedy_rows, 0.0, 1.0)
    top_p = torch.where(greedy_rows, 1.0, 0.9)
    roots = torch.full((s,), ROOT, dtype=torch.int64)
    x, toks, qs = roots, [], []
    for _ in range(3):
        q = q_table[x]
        x = sample(q, g)
        toks.append(x)
        qs.append(q)
    prop = chain_proposal(roots, torch.stack(toks, 1), torch.stack(qs, 1))
    probs = processed_probs(raw[prop.tokens], temp, top_p, 0)  # [S, 4, V] per-row settings
    res = verify_sampling(prop, probs, g)
    first = res.tokens[:, 0]
    assert (first[greedy_rows] == raw[ROOT].argmax()).all()
    p_root = processed_probs(raw[ROOT].unsqueeze(0), 1.0, 0.9, 0)[0]
    counts = torch.bincount(first[~greedy_rows], minlength=VOCAB)
    assert chi_square_pvalue(counts, p_root) > PASS
    # greedy rows accept exactly the drafts that equal the greedy path
    greedy_path = [ROOT]
    for _ in range(4):
        greedy_path.append(int(raw[greedy_path[-1]].argmax()))
    for b in torch.nonzero(greedy_rows).flatten()[:200].tolist():
        n = int(res.num_emitted[b])
        assert res.tokens[b, :n].tolist() == greedy_path[1 : n + 1]
