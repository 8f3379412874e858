"""Tree geometry (depths, ancestor mask, child tables) and the chain / top-k tree builders.

Run: python -m pytest tests/spec/test_spec_tree.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.speculative.proposers.draft_tree import (
    ancestor_mask,
    chain_proposal,
    children_table,
    node_depths,
    topk_tree,
    validate_proposal,
)


def random_forest(bsz: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((bsz, n), -1, dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bsz,), generator=g)
    counts = torch.randint(1, n + 1, (bsz,), generator=g)
    return torch.where(torch.arange(n) < counts.unsqueeze(1), parents, -1), counts


def test_mask_and_depths_match_parent_walk() -> None:
    parents, counts = random_forest(16, 20, 0)
    mask = ancestor_mask(parents)
    depth = node_depths(parents)
    for b in range(16):
        for i in range(20):
            chain, j = {i}, int(parents[b, i])
            while j >= 0:
                chain.add(j)
                j = int(parents[b, j])
            assert set(mask[b, i].nonzero().flatten().tolist()) == chain
            assert int(depth[b, i]) == len(chain) - 1


def test_deep_chain_mask_is_lower_triangular() -> None:
    prop = chain_proposal(torch.tensor([1]), torch.arange(40).view(1, 40))
    assert torch.equal(ancestor_mask(prop.parents)[0], torch.ones(41, 41, dtype=torch.bool).tril())
    assert node_depths(prop.parents)[0].tolist() == list(range(41))


def test_children_table() -> None:
    parents, counts = random_forest(8, 15, 1)
    table = children_table(parents, counts)
    for b in range(8):
        for i in range(15):
            expect = [j for j in range(1, int(counts[b])) if int(parents[b, j]) == i]
            got = [c for c in table[b, i].tolist() if c >= 0]
            assert got == expect


def test_chain_proposal_shifts_draft_probs() -> None:
    q = torch.softmax(torch.randn(2, 3, 5), -1)
    prop = chain_proposal(torch.tensor([7, 8]), torch.tensor([[1, 2, 3], [4, 0, 0]]), q, torch.tensor([3, 1]))
    assert prop.tokens.tolist() == [[7, 1, 2, 3], [8, 4, 0, 0]]
    assert prop.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, -1, -1]]
    assert prop.counts.tolist() == [4, 2]
    assert prop.draft_probs is not None and torch.equal(prop.draft_probs[:, :3], q)
    assert (prop.draft_probs[:, 3] == 0).all()


def test_topk_tree_keeps_best_paths_within_budget() -> None:
    # root -> level 0 candidates a (logp -0.1), b (-1.0), c (-3.0); level 1: a's children (-0.2, -2.5), b's (-0.1)
    l0 = torch.tensor([[10, 11, 12]])
    lp0 = torch.tensor([[-0.1, -1.0, -3.0]])
    l1 = torch.tensor([[20, 21, 22]])
    par1 = torch.tensor([[0, 0, 1]])
    lp1 = torch.tensor([[-0.2, -2.5, -0.1]])
    prop = topk_tree(torch.tensor([5]), [l0, l1], [torch.zeros_like(l0), par1], [lp0, lp1], budget=5)
    # cumulative: a -0.1, b -1.0, c -3.0, a/20 -0.3, a/21 -2.6, b/22 -1.1 -> keep a, a/20, b, b/22
    assert prop.counts.tolist() == [5]
    assert prop.tokens[0].tolist() == [5, 10, 11, 20, 22]
    assert prop.parents[0].tolist() == [-1, 0, 0, 1, 2]
    assert prop.draft_probs is None


def test_topk_tree_random_is_ancestor_closed_and_optimal() -> None:
    g = torch.Generator().manual_seed(3)
    bsz, k, depth = 6, 3, 4
    root = torch.zeros(bsz, dtype=torch.int64)
    tokens, parents, logps = [], [], []
    width, first_id = 1, 1
    for d in range(depth):
        m = width * k
        tokens.append(torch.arange(first_id, first_id + m).expand(bsz, m))  # unique ids identify candidates
        first_id += m
        parents.append(torch.arange(m).div(k, rounding_mode="floor").expand(bsz, m).clone())
        lp = torch.log_softmax(torch.randn(bsz, m, generator=g), -1)
        lp[0, :] = -math.inf if d == 3 else lp[0, :]  # row 0 has no depth-3 candidates
        logps.append(lp)
        width = m
    budget = 12
    prop = topk_tree(root, tokens, parents, logps, budget)
    assert (prop.counts <= budget).all() and (prop.counts == budget).all()
    depth_of = node_depths(prop.parents)
    assert int(depth_of[0].max()) <= 3
    # cumulative log-prob of every candidate, by id; the kept ids must be the budget-1 best
    score: list[dict[int, float]] = [{0: 0.0} for _ in range(bsz)]
    prev_ids = [torch.zeros(bsz, 1, dtype=torch.int64)]
    for d in range(depth):
        for b in range(bsz):
            for j in range(tokens[d].shape[1]):
                parent_id = 0 if d == 0 else int(prev_ids[-1][b, int(parents[d][b, j])])
                score[b][int(tokens[d][b, j])] = score[b][parent_id] + float(logps[d][b, j])
        prev_ids.append(tokens[d])
    for b in range(bsz):
        for i in range(1, int(prop.counts[b])):
            assert 0 <= int(prop.parents[b, i]) < i  # parents first
        kept = sorted(score[b][int(t)] for t in prop.tokens[b, 1 : int(prop.counts[b])])
        finite = sorted(v for key, v in score[b].items() if key != 0 and v > -math.inf)
        assert kept == finite[-(budget - 1) :]


def test_validate_proposal() -> None:
    good = chain_proposal(torch.tensor([1, 2]), torch.tensor([[3, 4], [5, 6]]), num_drafts=torch.tensor([2, 1]))
    validate_proposal(good, max_nodes=3, max_depth=2)
    with pytest.raises(ValueError, match="deeper"):
        validate_proposal(good, max_depth=1)
    with pytest.raises(ValueError, match="more than"):
        validate_proposal(good, max_nodes=2)
    bad_parent = DraftProposal(good.tokens, torch.tensor([[-1, 0, 2], [-1, 0, -1]]), good.counts)
    with pytest.raises(ValueError, match="smaller index"):
        validate_proposal(bad_parent)
    bad_pad = DraftProposal(good.tokens, torch.tensor([[-1, 0, 1], [-1, 0, 1]]), good.counts)
    with pytest.raises(ValueError, match="padding"):
        validate_proposal(bad_pad)
