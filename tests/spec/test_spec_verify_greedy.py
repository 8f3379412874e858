"""Greedy verification emits exactly the target's greedy continuation (chains, trees, partial / full acceptance).

Run: python -m pytest tests/spec/test_spec_verify_greedy.py -q
"""

from __future__ import annotations

import torch

from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.decoding.sampling import processed_probs
from worker.tlt.speculative.proposers.draft_tree import chain_proposal
from worker.tlt.speculative.verify.verifier import truncate_emitted, verify_greedy, verify_sampling


def reference_walk(tokens: list[int], parents: list[int], count: int, argmax: list[int]) -> tuple[list[int], list[int]]:
    """Plain-Python greedy walk: (emitted tokens, accepted nodes)."""
    cur, emitted, nodes = 0, [], []
    while True:
        want = argmax[cur]
        kids = [i for i in range(1, count) if parents[i] == cur and tokens[i] == want]
        emitted.append(want)
        if not kids:
            return emitted, nodes
        cur = kids[0]
        nodes.append(cur)


def test_chain_partial_and_full_acceptance() -> None:
    g = torch.Generator().manual_seed(0)
    bsz, k, vocab = 64, 5, 13
    logits = torch.randn(bsz, k + 1, vocab, generator=g)
    target = logits.argmax(-1)  # [B, k+1] greedy token after node i
    accept = torch.arange(bsz) % (k + 1)  # rows accept 0..k drafts
    drafts = target[:, :k].clone()
    rows = torch.arange(bsz)
    wrong = accept < k
    drafts[rows[wrong], accept[wrong]] = (target[rows[wrong], accept[wrong]] + 1) % vocab
    root = torch.randint(0, vocab, (bsz,), generator=g)
    prop = chain_proposal(root, drafts)
    for res in (verify_greedy(prop, logits), verify_sampling(prop, processed_probs(logits, 0.0), g)):
        assert torch.equal(res.num_emitted, accept + 1)
        for b in range(bsz):
            a = int(accept[b])
            assert res.tokens[b, : a + 1].tolist() == target[b, : a + 1].tolist()
            assert res.accepted_nodes[b, :a].tolist() == list(range(1, a + 1))
            assert (res.accepted_nodes[b, a:] == -1).all()
    lp = verify_greedy(prop, logits).logprobs
    full = rows[accept == k]
    expect = torch.log_softmax(logits, -1)[full, k, target[full, k]]
    assert torch.allclose(lp[full, k], expect)


def test_ragged_chain_counts() -> None:
    logits = torch.randn(3, 4, 7)
    target = logits.argmax(-1)
    prop = chain_proposal(torch.zeros(3, dtype=torch.int64), target[:, :3], num_drafts=torch.tensor([0, 1, 3]))
    res = verify_greedy(prop, logits)
    assert res.num_emitted.tolist() == [1, 2, 4]
    assert res.tokens[0, 0] == target[0, 0] and res.tokens[1, :2].tolist() == target[1, :2].tolist()


def test_random_trees_match_reference_walk() -> None:
    g = torch.Generator().manual_seed(1)
    bsz, n, vocab = 200, 12, 5  # small vocab: many accidental matches, several matching siblings
    parents = torch.full((bsz, n), -1, dtype=torch.int64)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bsz,), generator=g)
    counts = torch.randint(1, n + 1, (bsz,), generator=g)
    parents = torch.where(torch.arange(n) < counts.unsqueeze(1), parents, -1)
    tokens = torch.randint(0, vocab, (bsz, n), generator=g)
    logits = torch.randn(bsz, n, vocab, generator=g)
    prop = DraftProposal(tokens=tokens, parents=parents, counts=counts)
    res = verify_greedy(prop, logits)
    res_s = verify_sampling(prop, processed_probs(logits, 0.0), g)
    argmax = logits.argmax(-1)
    longest = 0
    for b in range(bsz):
        emitted, nodes = reference_walk(tokens[b].tolist(), parents[b].tolist(), int(counts[b]), argmax[b].tolist())
        for r in (res, res_s):
            m = int(r.num_emitted[b])
            assert r.tokens[b, :m].tolist() == emitted
            assert r.accepted_nodes[b, : m - 1].tolist() == nodes
        longest = max(longest, len(nodes))
    assert longest >= 2  # the test exercised multi-step acceptance


def test_markov_target_sd_equals_plain_greedy() -> None:
    """End to end on a bigram target: SD with random (often wrong) drafts reproduces plain greedy decoding."""
    g = torch.Generator().manual_seed(2)
    vocab, bsz, steps_out = 9, 32, 20
    table = torch.randn(vocab, vocab, generator=g)  # logits of the next token given the previous one
    start = torch.randint(0, vocab, (bsz,), generator=g)
    plain = [start.tolist()]
    cur = start
    for _ in range(steps_out):
        cur = table[cur].argmax(-1)
        plain.append(cur.tolist())
    expect = torch.tensor(plain).T[:, 1:]  # [B, steps_out]
    out: list[list[int]] = [[] for _ in range(bsz)]
    last = start.clone()
    while min(len(o) for o in out) < steps_out:
        k = int(torch.randint(1, 6, (1,), generator=g))
        greedy_path = [last]
        for _ in range(k):
            greedy_path.append(table[greedy_path[-1]].argmax(-1))
        drafts = torch.stack(greedy_path[1:], 1)
        noise = torch.rand(bsz, k, generator=g) < 0.2
        drafts = torch.where(noise, torch.randint(0, vocab, (bsz, k), generator=g), drafts)
        prop = chain_proposal(last, drafts)
        res = verify_greedy(prop, table[prop.tokens])
        for b in range(bsz):
            out[b].extend(res.tokens[b, : int(res.num_emitted[b])].tolist())
        last = res.tokens.gather(1, (res.num_emitted - 1).unsqueeze(1)).squeeze(1)
    assert torch.equal(torch.tensor([o[:steps_out] for o in out]), expect)


def test_truncate_emitted_eos_and_budget() -> None:
    prop = chain_proposal(torch.zeros(3, dtype=torch.int64), torch.tensor([[5, 2, 5], [1, 1, 1], [5, 3, 4]]))
    logits = torch.full((3, 4, 6), -5.0)
    # rows 0/2 target: 5, 2, 5, 1 ; row 1 target: 1, 1, 1, 0
    for b, seq in enumerate([[5, 2, 5, 1], [1, 1, 1, 0], [5, 3, 4, 4]]):
        for i, t in enumerate(seq):
            logits[b, i, t] = 5.0
    res = verify_greedy(prop, logits)
    assert res.num_emitted.tolist() == [4, 4, 4]
    n, fin = truncate_emitted(res, torch.tensor([2]), torch.tensor([10, 10, 3]))
    assert n.tolist() == [2, 4, 3] and fin.tolist() == [True, False, True]


def test_max_depth_caps_the_walk() -> None:
    logits = torch.randn(2, 4, 7)
    target = logits.argmax(-1)
    prop = chain_proposal(torch.zeros(2, dtype=torch.int64), target[:, :3])  # fully acceptable chain
    for res in (verify_greedy(prop, logits, max_depth=1), verify_sampling(prop, processed_probs(logits, 0.0), None, 1)):
        assert res.num_emitted.tolist() == [2, 2] and res.tokens.shape == (2, 2)
        assert torch.equal(res.tokens, target[:, :2]) and res.accepted_nodes[:, 0].tolist() == [1, 1]
    full = verify_greedy(prop, logits, max_depth=3, max_children=1)
    assert full.num_emitted.tolist() == [4, 4] and torch.equal(full.tokens, target)
