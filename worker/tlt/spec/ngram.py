"""Model-free cold-start drafter: suffix / n-gram matching over a sequence's own history and its GRPO siblings.

Responses to one prompt share whole phrases (the restated question, the same equations, the answer format), so the
last few tokens of a sequence often occur earlier in its own text or in a sibling's, followed by what it will say
next. `NGramProposer` looks up the last `min_n` tokens in a per-group index, extends each match backwards up to
`max_n` tokens, keeps the longest matches (most recent first) and drafts what followed them: a chain of the most
frequent continuation (`topk=1`) or a small tree of the distinct continuations (`topk>1`), within the verify budget
and depth of the context. Drafts are deterministic (draft_probs None), so the verifier's one-hot rule keeps sampling
exact.

Index: per group, a dict from `min_n`-token keys to (member, position) codes, built lazily the first time a group is
drafted for and then extended only with the tokens appended since (members' histories only grow during a rollout).
The shared prompt is indexed once per group, not once per sibling.

    drafter = NGramProposer(NGramConfig(topk=2))
    proposal = drafter.propose(ctx)          # ctx: proposer.DraftContext
    drafter.reset()                          # at the end of a rollout

Run the tests: `python -m pytest tests/spec/test_spec_ngram.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .proposer import DraftContext
from .types import DraftProposal

_SHIFT = 32  # code = member << _SHIFT | continuation position


@dataclass(frozen=True)
class NGramConfig:
    # shortest suffix that counts as a match (the index key length); 1 measured best on SmolLM2 GSM8K samples (T=1)
    min_n: int = 1
    max_n: int = 6  # longest suffix compared when ranking matches
    topk: int = 1  # continuations kept per node: 1 drafts a chain, >1 a tree of distinct continuations
    max_matches: int = 16  # matches (of the best length) whose continuations are merged
    max_scan: int = 64  # most recent index hits examined per lookup (bounds the cost on frequent keys)
    use_siblings: bool = True  # False: only the sequence's own history (classic prompt lookup)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        if self.topk < 1:
            raise ValueError("topk must be >= 1")


@dataclass
class _GroupIndex:
    table: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # key -> codes
    members: dict[int, Sequence[int]] = field(default_factory=dict)  # sample id -> history (a reference)
    indexed: dict[int, int] = field(default_factory=dict)  # sample id -> next key start not yet indexed
    prompt: tuple[int, ...] | None = None  # the prompt of the first indexed member

    def catch_up(self, member: int, hist: Sequence[int], prompt_len: int, n: int) -> None:
        start = self.indexed.get(member)
        if start is None or len(hist) < start:  # new member, or a history that shrank (not expected): re-index
            if start is not None:
                self._drop(member)
            prompt = tuple(hist[:prompt_len])
            start = 0
            if self.prompt is None:
                self.prompt = prompt
            elif prompt == self.prompt:
                start = max(0, prompt_len - n)  # the prompt's keys are indexed already (under the first member)
        self.members[member] = hist
        end = len(hist) - n  # a key starting at s has its continuation at s + n, which must exist
        if end <= start:
            self.indexed[member] = max(start, self.indexed.get(member, 0))
            return
        table, base = self.table, member << _SHIFT
        window = list(hist[start : end + n - 1])  # exactly end - start keys, each with a continuation
        shifted = (window[i:] for i in range(n))  # zip of the shifted copies = the n-token keys, made in C
        for code, key in enumerate(zip(*shifted, strict=False), start=base | (start + n)):
            codes = table.get(key)
            if codes is None:
                table[key] = [code]
            else:
                codes.append(code)
        self.indexed[member] = end

    def _drop(self, member: int) -> None:
        for key, codes in list(self.table.items()):
            kept = [c for c in codes if c >> _SHIFT != member]
            if kept:
                self.table[key] = kept
            else:
                del self.table[key]
        self.indexed.pop(member, None)


@dataclass
class _Trie:
    tokens: list[int] = field(default_factory=lambda: [0])
    parents: list[int] = field(default_factory=lambda: [-1])
    counts: list[int] = field(default_factory=lambda: [0])
    depths: list[int] = field(default_factory=lambda: [0])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])

    def add(self, continuation: Sequence[int]) -> None:
        node = 0
        self.counts[0] += 1
        for tok in continuation:
            nxt = self.children[node].get(tok)
            if nxt is None:
                nxt = len(self.tokens)
                self.children[node][tok] = nxt
                self.tokens.append(tok)
                self.parents.append(node)
                self.counts.append(0)
                self.depths.append(self.depths[node] + 1)
                self.children.append({})
            self.counts[nxt] += 1
            node = nxt

    def select(self, topk: int, budget: int) -> list[int]:
        """Up to budget-1 nodes (root excluded): at most topk children per node, most supported first; returned in
        breadth-first order so parents precede children. Counts never grow along a path and ties go to the shallower,
        then earlier-created node (matches are added most recent first), so the selection is closed under ancestors."""
        eligible: list[int] = []
        frontier = [0]
        while frontier:
            nxt_frontier = []
            for node in frontier:
                kids = sorted(self.children[node].values(), key=lambda i: (-self.counts[i], i))[:topk]
                eligible.extend(kids)
                nxt_frontier.extend(kids)
            frontier = nxt_frontier
        chosen = sorted(eligible, key=lambda i: (-self.counts[i], self.depths[i], i))[: max(budget - 1, 0)]
        return sorted(chosen, key=lambda i: (self.depths[i], -self.counts[i], i))


class NGramProposer:
    """Implements proposer.Proposer without a model."""

    def __init__(self, config: NGramConfig | None = None) -> None:
        self.config = config or NGramConfig()
        self._groups: dict[tuple[int, int], _GroupIndex] = {}  # (group, -1) or (group, sample) -> index

    def reset(self) -> None:
        self._groups.clear()

    def _indexes_for(self, ctx: DraftContext) -> list[_GroupIndex]:
        """The index of each row, brought up to date (each group's siblings once per call, not once per row)."""
        cfg = self.config
        out: list[_GroupIndex] = []
        synced: set[int] = set()
        for b in range(ctx.batch_size):
            gid = ctx.group_ids[b]
            key: tuple[int, int] = (gid, -1) if cfg.use_siblings else (gid, ctx.sample_ids[b])
            index = self._groups.get(key)
            if index is None:
                index = self._groups[key] = _GroupIndex()
            if cfg.use_siblings and ctx.groups is not None and gid in ctx.groups and gid not in synced:
                synced.add(gid)
                for member, hist in enumerate(ctx.groups[gid]):
                    index.catch_up(member, hist, ctx.prompt_lens[b], cfg.min_n)
            index.catch_up(ctx.sample_ids[b], ctx.histories[b], ctx.prompt_lens[b], cfg.min_n)
            out.append(index)
        return out

    def _draft_row(self, index: _GroupIndex, hist: Sequence[int], max_depth: int, budget: int) -> _Trie:
        cfg = self.config
        trie = _Trie()
        length = len(hist)
        if length < cfg.min_n or max_depth < 1 or budget < 2:
            return trie
        codes = index.table.get(tuple(hist[length - cfg.min_n :]))
        if not codes:
            return trie
        tail = list(hist[max(0, length - cfg.max_n) :])  # the suffix compared backwards
        best, matches = 0, []
        for code in reversed(codes[-cfg.max_scan :]):
            other = index.members[code >> _SHIFT]
            pos = code & ((1 << _SHIFT) - 1)
            n = cfg.min_n
            while n < len(tail) and pos - n - 1 >= 0 and other[pos - n - 1] == tail[-n - 1]:
                n += 1
            if n > best:
                best, matches = n, [(other, pos)]
            elif n == best and len(matches) < cfg.max_matches:
                matches.append((other, pos))
        for other, pos in matches:
            trie.add(other[pos : pos + max_depth])
        return trie

    def propose(self, ctx: DraftContext) -> DraftProposal:
        bsz = ctx.batch_size
        rows: list[tuple[list[int], list[int]]] = []
        for b, index in enumerate(self._indexes_for(ctx)):
            trie = self._draft_row(index, ctx.histories[b], ctx.max_depth, ctx.max_nodes)
            chosen = trie.select(self.config.topk, ctx.max_nodes)
            new_index = {0: 0}
            toks, pars = [ctx.histories[b][-1]], [-1]
            for i in chosen:
                new_index[i] = len(toks)
                toks.append(trie.tokens[i])
                pars.append(new_index[trie.parents[i]])
            rows.append((toks, pars))
        width = max((len(t) for t, _ in rows), default=1)
        tokens = torch.tensor([t + [0] * (width - len(t)) for t, _ in rows], dtype=torch.int64).view(bsz, width)
        parents = torch.tensor([p + [-1] * (width - len(p)) for _, p in rows], dtype=torch.int64).view(bsz, width)
        counts = torch.tensor([len(t) for t, _ in rows], dtype=torch.int64).view(bsz)
        return DraftProposal(tokens=tokens.to(ctx.device), parents=parents.to(ctx.device), counts=counts.to(ctx.device))
