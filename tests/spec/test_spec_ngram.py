"""The n-gram / suffix drafter: own-history and sibling matches, budgets, incremental index, exactness with verify.

Run: python -m pytest tests/spec/test_spec_ngram.py -q
"""

from __future__ import annotations

import random

import pytest
import torch

from worker.tlt.speculative.proposers import ngram
from worker.tlt.speculative.proposers.draft_tree import node_depths, validate_proposal
from worker.tlt.speculative.proposers.ngram import NGramConfig, NGramProposer
from worker.tlt.speculative.proposers.protocol import DraftContext, empty_proposal
from worker.tlt.speculative.verify.verifier import verify_greedy

PROMPT = [100, 101, 102, 103]


def ctx_for(
    groups: dict[int, list[list[int]]], rows: list[tuple[int, int]], max_nodes: int, max_depth: int, topk: int = 1
) -> DraftContext:
    return DraftContext(
        histories=[groups[g][s] for g, s in rows],
        prompt_lens=[len(PROMPT)] * len(rows),
        group_ids=[g for g, _ in rows],
        sample_ids=[s for _, s in rows],
        max_nodes=max_nodes,
        max_depth=max_depth,
        topk=topk,
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
    drafter = NGramProposer()
    prop = drafter.propose(ctx_for(groups, [(0, 3)], max_nodes=4, max_depth=2, topk=2))
    validate_proposal(prop, max_nodes=4, max_depth=2)
    n = int(prop.counts[0])
    assert n == 4
    toks = prop.tokens[0, :n].tolist()
    pars = prop.parents[0, :n].tolist()
    # most supported: 4 (twice), then 9 (once) at depth 1; then 4's children 5 / 6 tie: the most recent (6) wins
    assert toks == [3, 4, 9, 6] and pars == [-1, 0, 0, 1]
    assert int(node_depths(prop.parents).max()) <= 2
    chain = NGramProposer().propose(ctx_for(groups, [(0, 3)], max_nodes=16, max_depth=2, topk=1))
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
    corpus = drafter._corpus
    assert corpus.lens[:2].tolist() == [len(s0), len(me)]  # only the new tokens were copied in
    assert corpus.tok[0, : len(s0)].tolist() == s0 and corpus.tok[1, : len(me)].tolist() == me
    # occurrences = key ends with a continuation; the shared prompt counts once (the sibling's start at its response)
    assert corpus.hit_from[:2].tolist() == [1, len(PROMPT) - 1]
    assert sum(len(level) for level in corpus.levels) == (len(s0) - 2) + (len(me) - len(PROMPT))
    drafter.reset()
    assert corpus is not drafter._corpus and drafter._corpus.levels == []


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


# ---- the vectorised drafter against a plain-Python statement of its rule ----------------------------------------
def reference_drafts(groups: dict[int, list[list[int]]], rows: list[tuple[int, int]], cfg: NGramConfig, topk: int,
                     plen: int, max_nodes: int, max_depth: int) -> list[tuple[list[int], list[int]]]:
    """(tokens, parents) per row from the final histories: every occurrence of the row's last min_n tokens that has
    a continuation (a sibling's shared prompt not counted twice), the max_scan latest by (key end, member), the
    longest backward matches (at most max_matches, latest first), then a trie of their continuations."""
    out = []
    for g, s in rows:
        members = groups[g]
        me = members[s]
        n0 = cfg.min_n
        key = me[len(me) - n0:]
        occ = []
        for m, h in enumerate(members):
            first = n0 - 1 if m == 0 or h[:plen] != members[0][:plen] else max(n0 - 1, plen - 1)
            occ += [(q, m) for q in range(first, len(h) - 1) if h[q - n0 + 1 : q + 1] == key]
        occ = sorted(occ)[-cfg.max_scan :][::-1]
        tail = me[max(0, len(me) - cfg.max_n):]
        scored = []
        for q, m in occ:
            h, n = members[m], n0
            while n < len(tail) and q - n >= 0 and h[q - n] == tail[-n - 1]:
                n += 1
            scored.append((n, q, m))
        best = max((n for n, _, _ in scored), default=0)
        trie = ngram._Trie()
        depth = max_depth if topk > 1 else min(max_depth, max_nodes - 1)
        if len(me) >= n0 and depth >= 1 and max_nodes >= 2:
            for q, m in [(q, m) for n, q, m in scored if n == best][: cfg.max_matches]:
                trie.add(members[m][q + 1 : q + 1 + depth])
        idx, toks, pars = {0: 0}, [me[-1]], [-1]
        for i in trie.select(topk, max_nodes):
            idx[i] = len(toks)
            toks.append(trie.tokens[i])
            pars.append(idx[trie.parents[i]])
        out.append((toks, pars))
    return out


def random_group(rng: random.Random, members: int, vocab: int, length: int) -> list[list[int]]:
    """Sibling responses stitched from a shared phrase book, so that long matches and ties both occur."""
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(2, 6))] for _ in range(8)]
    out = []
    for _ in range(members):
        h = list(PROMPT)
        while len(h) < length:
            h += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(vocab)]
        out.append(h[: rng.randint(len(PROMPT) + 1, length)])
    return out


def as_lists(prop) -> list[tuple[list[int], list[int]]]:
    n = prop.counts.tolist()
    return [(prop.tokens[b, : n[b]].tolist(), prop.parents[b, : n[b]].tolist()) for b in range(len(n))]


@pytest.mark.parametrize(("cfg", "topk"), [(NGramConfig(), 1), (NGramConfig(min_n=2, max_n=4, max_scan=8, max_matches=3), 1),
                                           (NGramConfig(), 2), (NGramConfig(min_n=3, max_matches=4), 3)])
def test_vectorised_drafts_equal_the_reference_rule(cfg: NGramConfig, topk: int) -> None:
    rng = random.Random(7)
    for trial in range(12):
        groups = {g: random_group(rng, rng.randint(1, 5), vocab=6 + trial, length=60) for g in range(3)}
        rows = [(g, s) for g in groups for s in range(len(groups[g])) if rng.random() < 0.7] or [(0, 0)]
        nodes, depth = rng.choice([(2, 1), (5, 4), (8, 3), (16, 6)])
        prop = NGramProposer(cfg).propose(ctx_for(groups, rows, nodes, depth, topk))
        validate_proposal(prop, max_nodes=nodes, max_depth=depth)
        assert as_lists(prop) == reference_drafts(groups, rows, cfg, topk, len(PROMPT), nodes, depth)


@pytest.mark.parametrize("topk", [1, 2])
def test_incremental_index_drafts_what_a_fresh_one_drafts(topk: int) -> None:
    """Histories grow between calls (tokens of several steps at once, siblings finishing); at every call the
    long-lived drafter equals a drafter built from scratch on the same histories."""
    rng = random.Random(3)
    finals = {g: random_group(rng, 4, vocab=9, length=120) for g in range(3)}
    groups = {g: [h[: len(PROMPT) + 1] for h in hs] for g, hs in finals.items()}
    live = NGramProposer()
    for _ in range(40):
        for g, hs in groups.items():
            for s, h in enumerate(hs):
                h.extend(finals[g][s][len(h) : len(h) + rng.randint(0, 7)])  # same list objects, as the engine
        rows = [(g, s) for g in groups for s in range(4) if len(groups[g][s]) < len(finals[g][s])] or [(0, 0)]
        got = as_lists(live.propose(ctx_for(groups, rows, 8, 6, topk)))
        fresh = as_lists(NGramProposer().propose(ctx_for(groups, rows, 8, 6, topk)))
        assert got == fresh
