"""The n-gram / suffix drafter: own-history and sibling matches, budgets, incremental index, exactness with verify.

Run: python -m pytest tests/spec/test_spec_ngram.py -q
"""

from __future__ import annotations

import torch

from worker.tlt.spec.ngram import NGramConfig, NGramProposer
from worker.tlt.spec.proposer import DraftContext, empty_proposal
from worker.tlt.spec.tree import node_depths, validate_proposal
from worker.tlt.spec.verify import verify_greedy

PROMPT = [100, 101, 102, 103]


def ctx_for(
    groups: dict[int, list[list[int]]], rows: list[tuple[int, int]], max_nodes: int, max_depth: int
) -> DraftContext:
    return DraftContext(
        histories=[groups[g][s] for g, s in rows],
        prompt_lens=[len(PROMPT)] * len(rows),
        group_ids=[g for g, _ in rows],
        sample_ids=[s for _, s in rows],
        max_nodes=max_nodes,
        max_depth=max_depth,
        groups=groups,
    )


def drafted(prop, b: int) -> list[int]:  # the chain of row b (tokens after the root)
    return prop.tokens[b, 1 : int(prop.counts[b])].tolist()


def test_finds_sibling_phrase() -> None:
    sibling = PROMPT + [1, 2, 3, 4, 5, 6, 7, 8, 9]  # a finished sibling
    me = PROMPT + [50, 3, 4]  # just produced "3 4": the sibling went on with 5 6 7 ...
    groups = {0: [sibling, me]}
    prop = NGramProposer(NGramConfig(min_n=2, max_n=4)).propose(ctx_for(groups, [(0, 1)], max_nodes=5, max_depth=8))
    assert prop.tokens[0, 0] == 4  # root = last emitted token
    assert drafted(prop, 0) == [5, 6, 7, 8]  # budget 5 nodes = root + 4
    assert prop.draft_probs is None


def test_siblings_can_be_switched_off_and_own_history_still_matches() -> None:
    sibling = PROMPT + [1, 2, 3, 4, 5, 6]
    me = PROMPT + [7, 8, 9, 7, 8]
    groups = {0: [sibling, me, PROMPT + [3, 4]]}
    off = NGramProposer(NGramConfig(use_siblings=False))
    prop = off.propose(ctx_for(groups, [(0, 1), (0, 2)], max_nodes=8, max_depth=3))
    assert drafted(prop, 0) == [9, 7, 8]  # own earlier "7 8" -> 9 7 8
    assert drafted(prop, 1) == []  # "3 4" only occurs in the sibling
    on = NGramProposer()
    assert drafted(on.propose(ctx_for(groups, [(0, 2)], max_nodes=8, max_depth=3)), 0) == [5, 6]


def test_prompt_phrases_are_found_and_longest_match_wins() -> None:
    prompt = [10, 11, 12, 13, 14, 20, 12, 13, 15]  # "12 13" continues with 14 after "11", with 15 after "20"
    me = prompt + [7, 20, 12, 13]  # longer suffix "20 12 13" matches the second occurrence
    groups = {3: [me]}
    ctx = DraftContext(
        histories=[me],
        prompt_lens=[len(prompt)],
        group_ids=[3],
        sample_ids=[0],
        max_nodes=3,
        max_depth=4,
        groups=groups,
    )
    assert drafted(NGramProposer().propose(ctx), 0) == [15, 7]


def test_tree_of_distinct_continuations_respects_budget_and_depth() -> None:
    s0 = PROMPT + [1, 2, 3, 4, 5]
    s1 = PROMPT + [1, 2, 3, 9, 9]
    s2 = PROMPT + [1, 2, 3, 4, 6]
    me = PROMPT + [8, 2, 3]
    groups = {0: [s0, s1, s2, me]}
    drafter = NGramProposer(NGramConfig(topk=2))
    prop = drafter.propose(ctx_for(groups, [(0, 3)], max_nodes=4, max_depth=2))
    validate_proposal(prop, max_nodes=4, max_depth=2)
    n = int(prop.counts[0])
    assert n == 4
    toks = prop.tokens[0, :n].tolist()
    pars = prop.parents[0, :n].tolist()
    # most supported: 4 (twice), then 9 (once) at depth 1; then 4's children 5 / 6 tie: the most recent (6) wins
    assert toks == [3, 4, 9, 6] and pars == [-1, 0, 0, 1]
    assert int(node_depths(prop.parents).max()) <= 2
    chain = NGramProposer(NGramConfig(topk=1)).propose(ctx_for(groups, [(0, 3)], max_nodes=16, max_depth=2))
    assert drafted(chain, 0) == [4, 6]


def test_index_is_incremental_as_histories_grow() -> None:
    s0 = PROMPT + [1, 2]
    me = PROMPT + [5]
    groups = {0: [s0, me]}
    drafter = NGramProposer(NGramConfig(min_n=2))
    assert drafted(drafter.propose(ctx_for(groups, [(0, 1)], 6, 4)), 0) == []
    s0.extend([3, 4, 5, 6])  # the engine appends to the same lists
    me.extend([1, 2])
    assert drafted(drafter.propose(ctx_for(groups, [(0, 1)], 6, 4)), 0) == [3, 4, 5, 6]
    index = drafter._groups[(0, -1)]
    assert index.indexed == {0: len(s0) - 2, 1: len(me) - 2}
    prompt_keys = sum(len(v) for k, v in index.table.items() if k == (101, 102))
    assert prompt_keys == 1  # the shared prompt is indexed once, not once per sibling
    drafter.reset()
    assert drafter._groups == {}


def test_batch_padding_and_empty_rows() -> None:
    groups = {0: [PROMPT + [1, 2, 3], PROMPT + [1, 2]], 1: [[9]]}
    ctx = DraftContext(
        histories=[groups[0][1], groups[1][0]],
        prompt_lens=[4, 1],
        group_ids=[0, 1],
        sample_ids=[1, 0],
        max_nodes=4,
        max_depth=4,
        groups=groups,
    )
    prop = NGramProposer().propose(ctx)
    validate_proposal(prop, max_nodes=4, max_depth=4)
    assert prop.counts.tolist() == [2, 1] and prop.tokens[:, 0].tolist() == [2, 9]
    assert prop.parents[1].tolist() == [-1, -1]
    assert empty_proposal(ctx).counts.tolist() == [1, 1]


def test_greedy_sd_with_ngram_drafter_equals_plain_greedy() -> None:
    """Sibling drafts under a deterministic bigram target: SD output equals plain greedy, and drafts get accepted."""
    g = torch.Generator().manual_seed(0)
    vocab = 12
    table = torch.randn(vocab, vocab, generator=g)
    prompt = [1, 2, 3]
    plain = list(prompt)
    for _ in range(30):
        plain.append(int(table[plain[-1]].argmax()))
    groups = {0: [list(plain), list(prompt)]}  # a finished sibling already produced the same greedy text
    me = groups[0][1]
    drafter = NGramProposer(NGramConfig(min_n=1, max_n=3))
    emitted_per_step = []
    while len(me) < len(plain):
        ctx = DraftContext(
            histories=[me], prompt_lens=[3], group_ids=[0], sample_ids=[1], max_nodes=5, max_depth=4, groups=groups
        )
        prop = drafter.propose(ctx)
        res = verify_greedy(prop, table[prop.tokens])
        n = int(res.num_emitted[0])
        me.extend(res.tokens[0, :n].tolist())
        emitted_per_step.append(n)
    assert me[: len(plain)] == plain
    assert max(emitted_per_step) == 5
