"""Model-free cold-start drafter: suffix / n-gram matching over a sequence's own history and its GRPO siblings.

Responses to one prompt share whole phrases (the restated question, the same equations, the answer format), so the
last few tokens of a sequence often occur earlier in its own text or in a sibling's, followed by what it will say
next. `NGramProposer` finds the occurrences of the last `min_n` tokens in the group, examines the `max_scan` most
recent, extends each match backwards up to `max_n` tokens, keeps the longest matches (most recent first, at most
`max_matches`) and drafts what followed them: a chain of the most frequent continuation (`ctx.topk == 1`) or a small tree
of the distinct continuations (`ctx.topk > 1`), within the verify budget and depth of the context. Drafts are deterministic
(draft_probs None), so the verifier's one-hot rule keeps sampling exact.

Recency is canonical: an occurrence whose key ends at position q of member m ranks by (q, m), later first. It does
not depend on when the drafter was called, so an index built incrementally drafts exactly what one built from the
final histories drafts (tests/spec/test_spec_ngram.py checks it).

Data layout (why it is cheap): every history the drafter has seen this rollout is one row of a numpy token matrix,
and each occurrence (group, key, key end q, member) is one int64 in sorted "levels" merged LSM-style. Catching up
copies only the tokens appended since the last call and indexes them with one sort, so SD switching on after a
long stretch of plain decoding costs a copy and a sort of the new tokens, not a Python loop over them (measured on
CPU, 476k tokens of 512 GSM8K-like histories: 0.26-1.0 s before, 0.05-0.25 s now). A lookup is a binary search per
level for all rows at once; match extension, selection and the chain vote run on [rows, max_scan] /
[rows, max_matches, depth] arrays; only trees (`ctx.topk > 1`) build a small trie per row in Python. The shared prompt
counts once per group (under the first member seen), not once per sibling. Limits: 4096 samples per group,
131072 tokens per history, 65536 groups per rollout; keys of n > 1 tokens (or token ids >= 2^18) are hashed and
checked against the tokens, so a collision costs a scan slot, never a wrong match.

    drafter = NGramProposer(NGramConfig(min_n=1))
    proposal = drafter.propose(ctx)          # ctx: proposer.DraftContext (ctx.topk: chain or tree)
    drafter.reset()                          # at the end of a rollout

Run the tests: `python -m pytest tests/spec/test_spec_ngram.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.speculative.proposers.protocol import DraftContext, DrafterBase

_EMPTY = -1  # matrix cells past a member's history


@dataclass(frozen=True)
class NGramConfig:
    # shortest suffix that counts as a match (the key length); 1 measured best on SmolLM2 GSM8K samples (T=1)
    min_n: int = 1
    max_n: int = 6  # longest suffix compared when ranking matches
    max_matches: int = 16  # matches (of the best length) whose continuations are merged
    max_scan: int = 64  # most recent key occurrences examined per lookup (bounds the cost on frequent keys)
    use_siblings: bool = True  # False: only the sequence's own history (classic prompt lookup)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("need 1 <= min_n <= max_n")


# An occurrence is one int64: group slot | key | key end q | member. Sorting these sorts by (group, key) and, within
# a key, by recency (q, m); the low _REC_BITS are the recency rank.
_M_BITS, _Q_BITS, _K_BITS = 12, 17, 18  # 4096 samples per group, 131072 tokens, exact keys below 2^18
_REC_BITS = _Q_BITS + _M_BITS
_KEY_SHIFT = _REC_BITS
_GROUP_SHIFT = _REC_BITS + _K_BITS
_MAX_GROUPS = 1 << (63 - _GROUP_SHIFT)


def _keys(tokens_rev: np.ndarray) -> np.ndarray:  # [..., n] int64 key tokens, last first -> [...] int64
    """Key of an n-gram: the token itself when n = 1 and it fits, else a multiplicative hash (collisions are
    dropped at lookup, where the key's tokens are compared)."""
    if tokens_rev.shape[-1] == 1:
        return tokens_rev[..., 0] & ((1 << _K_BITS) - 1)
    h = np.zeros(tokens_rev.shape[:-1], dtype=np.int64)
    for j in range(tokens_rev.shape[-1]):
        h = h * np.int64(1000003) + tokens_rev[..., j]
    return (h ^ (h >> 29)) & ((1 << _K_BITS) - 1)


class _Corpus:
    """Every history the drafter has seen this rollout (one row of `tok` per sequence) and the occurrence index:
    sorted int64 levels merged LSM-style (a new level per call, two neighbours merged when the older is at most twice
    the newer), so a long stretch of new tokens costs one sort and a lookup costs a binary search per level."""

    def __init__(self, n: int) -> None:
        self.n = n  # key length (min_n)
        self.tok = np.full((16, 256), _EMPTY, dtype=np.int32)  # [S, L] tokens per sequence slot (capacity doubles)
        self.lens = np.zeros(16, dtype=np.int64)  # [S] tokens held
        self.hit_from = np.zeros(16, dtype=np.int64)  # [S] first key end q that counts as an occurrence
        self.member = np.zeros(16, dtype=np.int64)  # [S] member id within its group
        self.group_of = np.zeros(16, dtype=np.int64)  # [S] group slot
        self.slot_of: dict[tuple[tuple[int, int], int], int] = {}  # (group key, member) -> slot
        self.known: dict[tuple[tuple[int, int], int], int] = {}  # (group key, member) -> tokens held (fast check)
        self.groups: dict[tuple[int, int], int] = {}  # group key -> group slot
        self.table = np.full((0, 1), -1, dtype=np.int64)  # [G, M] slot of (group slot, member)
        self.owner: dict[int, tuple[int, tuple[int, ...]]] = {}  # group slot -> (first member seen, its prompt)
        self.levels: list[np.ndarray] = []  # sorted occurrence codes
        self._pending: list[tuple[int, int, int]] = []  # (slot, first q, end q) occurrences to index

    def group_slot(self, key: tuple[int, int]) -> int:
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = len(self.groups)
            if g >= _MAX_GROUPS:
                raise ValueError(f"the n-gram drafter holds at most {_MAX_GROUPS} groups per rollout")
            self.table = np.concatenate([self.table, np.full((1, self.table.shape[1]), -1, dtype=np.int64)])
        return g

    def _new_slot(self, g: int, gkey: tuple[int, int], member: int) -> int:
        if member >= 1 << _M_BITS:
            raise ValueError(f"the n-gram drafter supports at most {1 << _M_BITS} samples per group")
        slot = self.slot_of[(gkey, member)] = len(self.slot_of)
        if slot == self.tok.shape[0]:  # double the slot capacity
            self.tok = np.concatenate([self.tok, np.full_like(self.tok, _EMPTY)])
            self.lens, self.hit_from, self.member, self.group_of = (
                np.concatenate([a, np.zeros_like(a)]) for a in (self.lens, self.hit_from, self.member, self.group_of))
        self.member[slot], self.group_of[slot] = member, g
        if member >= self.table.shape[1]:
            self.table = np.pad(self.table, ((0, 0), (0, member + 1 - self.table.shape[1])), constant_values=-1)
        self.table[g, member] = slot
        return slot

    def catch_up(self, gkey: tuple[int, int], member: int, hist: Sequence[int], prompt_len: int) -> None:
        """Copy the tokens `hist` gained since the last call (histories only grow during a rollout)."""
        length = len(hist)
        if self.known.get((gkey, member)) == length:
            return
        self.known[(gkey, member)] = length
        slot = self.slot_of.get((gkey, member))
        g = self.group_slot(gkey)
        if slot is None:
            slot = self._new_slot(g, gkey, member)
        if length >= 1 << _Q_BITS:
            raise ValueError(f"the n-gram drafter indexes histories of at most {1 << _Q_BITS} tokens")
        start = int(self.lens[slot])
        if length < start:  # a history that shrank (not expected): forget everything, index it all again
            self.tok[slot], self.lens[slot], start = _EMPTY, 0, 0
            self.levels, self._pending = [], [(s, int(self.hit_from[s]), int(self.lens[s]) - 1)
                                              for s in self.slot_of.values()]
        if start == 0:
            prompt = tuple(hist[:prompt_len])
            owner = self.owner.setdefault(g, (member, prompt))
            shared = owner[0] != member and owner[1] == prompt
            # the owner's copy of a shared prompt already counts; a sibling's occurrences start at its response
            self.hit_from[slot] = max(self.n - 1, prompt_len - 1) if shared else self.n - 1
        if length > self.tok.shape[1]:
            width = self.tok.shape[1]
            while width < length:
                width *= 2
            self.tok = np.pad(self.tok, ((0, 0), (0, width - self.tok.shape[1])), constant_values=_EMPTY)
        self.tok[slot, start:length] = hist[start:length]
        self.lens[slot] = length
        # key ends q with a continuation (q + 1 < length) that were not occurrences before (q + 1 >= start)
        q0 = max(start - 1, int(self.hit_from[slot]))
        if length - 1 > q0:
            self._pending.append((slot, q0, length - 1))

    def flush(self) -> None:
        """Index the pending occurrences as one new sorted level, then merge levels of similar size."""
        if not self._pending:
            return
        slots, q0, q1 = (np.array(c, dtype=np.int64) for c in zip(*self._pending, strict=True))
        self._pending = []
        cnt = q1 - q0
        sl = np.repeat(slots, cnt)
        q = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(q0, cnt)
        rev = self.tok[sl[:, None], q[:, None] - np.arange(self.n)[None, :]].astype(np.int64)  # [N, n]
        code = (self.group_of[sl] << _GROUP_SHIFT) | (_keys(rev) << _KEY_SHIFT) | (q << _M_BITS) | self.member[sl]
        self.levels.append(np.sort(code))
        while len(self.levels) > 1 and self.levels[-2].shape[0] <= 2 * self.levels[-1].shape[0]:
            newer = self.levels.pop()
            self.levels[-1] = np.sort(np.concatenate([self.levels[-1], newer]), kind="stable")

    def lookup(self, g: np.ndarray, tail_rev: np.ndarray, h_len: np.ndarray,
               scan: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row (group slot g [B], its last tokens tail_rev [B, max_n], history length [B]): the `scan` most
        recent occurrences of its key -> (slot [B, S], key end q [B, S], valid [B, S]), latest first."""
        n = self.n
        base = (g << _GROUP_SHIFT) | (_keys(tail_rev[:, :n].astype(np.int64)) << _KEY_SHIFT)
        k = np.arange(scan)
        found = [np.full((g.shape[0], scan), -1, dtype=np.int64)]
        for level in self.levels:
            lo = np.searchsorted(level, base)
            hi = np.searchsorted(level, base + (1 << _KEY_SHIFT))
            idx = hi[:, None] - 1 - k[None, :]
            found.append(np.where(idx >= lo[:, None], level[idx.clip(0)], -1))
        code = np.concatenate(found, axis=1)
        code = -np.sort(-code, axis=1)[:, :scan]  # most recent first within the row's (group, key)
        ok = (code >= 0) & (h_len >= n)[:, None]
        code = np.where(ok, code, 0)
        q = (code >> _M_BITS) & ((1 << _Q_BITS) - 1)
        slot = self.table[g[:, None], code & ((1 << _M_BITS) - 1)]  # [B, S] (member 0's slot where not ok)
        slot = np.where(ok, slot, 0)
        for j in range(n):  # the key's tokens themselves (a hashed key may collide)
            ok &= self.tok[slot, (q - j).clip(0)] == tail_rev[:, j, None]
        return slot, q, ok


class NGramProposer(DrafterBase):
    """Implements proposer.Proposer without a model."""

    def __init__(self, config: NGramConfig | None = None) -> None:
        self.config = config or NGramConfig()
        self._corpus = _Corpus(self.config.min_n)

    def reset(self) -> None:
        self._corpus = _Corpus(self.config.min_n)

    def _catch_up(self, ctx: DraftContext) -> np.ndarray:  # -> [B] group slot of each row
        """Bring the corpus up to date (each group's siblings once per call, not once per row)."""
        cfg, corpus = self.config, self._corpus
        out = np.empty(ctx.batch_size, dtype=np.int64)
        synced: set[int] = set()
        for b in range(ctx.batch_size):
            gid, sid = ctx.group_ids[b], ctx.sample_ids[b]
            gkey = (gid, -1) if cfg.use_siblings else (gid, sid)
            if cfg.use_siblings and ctx.groups is not None and gid in ctx.groups and gid not in synced:
                synced.add(gid)
                for member, hist in enumerate(ctx.groups[gid]):
                    corpus.catch_up(gkey, member, hist, ctx.prompt_lens[b])
            corpus.catch_up(gkey, sid if cfg.use_siblings else 0, ctx.histories[b], ctx.prompt_lens[b])
            out[b] = corpus.group_slot(gkey)
        corpus.flush()
        return out

    def _matches(self, groups: np.ndarray, hists: Sequence[Sequence[int]], depth: int) -> tuple[np.ndarray, ...]:
        """-> (continuations [B, max_matches, depth] (-1 padding), alive [B, max_matches]): the longest matches,
        most recent first."""
        cfg, corpus = self.config, self._corpus
        n0, n_max, keep = cfg.min_n, cfg.max_n, cfg.max_matches
        bsz = len(hists)
        tail_rev = np.full((bsz, n_max), -2, dtype=np.int64)  # [B, max_n] hist[-1-j]; -2 past the start
        for i, h in enumerate(hists):
            t = h[max(0, len(h) - n_max):]
            tail_rev[i, : len(t)] = t[::-1]
        h_len = np.array([len(h) for h in hists], dtype=np.int64)
        slot, q, ok = corpus.lookup(groups, tail_rev, h_len, cfg.max_scan)  # [B, S] each
        # backward extension: the j-th token before the key's end, j = n0 .. max_n - 1, while it keeps matching
        js = np.arange(n0, n_max)
        qj = q[:, :, None] - js[None, None, :]  # [B, S, J]
        ext = (qj >= 0) & (js[None, None, :] < np.minimum(h_len, n_max)[:, None, None])
        ext &= corpus.tok[slot[:, :, None], qj.clip(0)] == tail_rev[:, None, n0:]
        length = n0 + np.logical_and.accumulate(ext, axis=2).sum(axis=2) if js.size else np.full_like(q, n0)
        length = np.where(ok, length, -1)
        alive = ok & (length == length.max(axis=1)[:, None])
        alive &= np.cumsum(alive, axis=1) <= keep  # the first max_matches of the best length, most recent first
        order = np.argsort(~alive, axis=1, kind="stable")[:, :keep]  # chosen matches first, recency kept
        alive = np.take_along_axis(alive, order, axis=1)
        ms, mq = np.take_along_axis(slot, order, axis=1), np.take_along_axis(q, order, axis=1)
        cq = mq[:, :, None] + 1 + np.arange(depth)[None, None, :]  # [B, K, D] continuation positions
        has = alive[:, :, None] & (cq < corpus.lens[ms][:, :, None])
        conts = np.where(has, corpus.tok[ms[:, :, None], cq.clip(max=corpus.tok.shape[1] - 1)], _EMPTY)
        return conts.astype(np.int64), alive

    def propose(self, ctx: DraftContext) -> DraftProposal:
        topk = max(ctx.topk, 1)
        depth = max(0, min(ctx.max_depth, ctx.max_nodes - 1) if topk == 1 else ctx.max_depth)
        groups = self._catch_up(ctx)
        roots = np.array([h[-1] for h in ctx.histories], dtype=np.int64)
        if depth >= 1 and ctx.max_nodes >= 2:
            conts, alive = self._matches(groups, ctx.histories, depth)
        else:
            conts = np.zeros((ctx.batch_size, 0, 0), dtype=np.int64)
            alive = np.zeros((ctx.batch_size, 0), dtype=bool)
        if topk == 1:
            tokens, parents, counts = _vote_chain(roots, conts, alive, depth if alive.size else 0)
        else:
            tokens, parents, counts = _trees(roots, conts, alive, topk, ctx.max_nodes)
        dev = ctx.device
        return DraftProposal(tokens=torch.from_numpy(tokens).to(dev), parents=torch.from_numpy(parents).to(dev),
                             counts=torch.from_numpy(counts).to(dev))


def _vote_chain(roots: np.ndarray, conts: np.ndarray, alive: np.ndarray,
                depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chain per row (vectorised): at each depth the continuation token most matches agree on (ties: the one of the
    most recent match), among the matches that agree with the chain so far. Equals the path a trie of the matches
    picks with one child per node."""
    bsz = roots.shape[0]
    chain = np.full((bsz, depth), _EMPTY, dtype=np.int64)
    ar = np.arange(bsz)
    for d in range(depth):
        t = conts[:, :, d]  # [B, K]
        has = alive & (t >= 0)
        if not has.any():
            break
        votes = ((t[:, :, None] == t[:, None, :]) & has[:, None, :]).sum(axis=2)  # [B, K] support of t[:, i]
        pick = np.where(has, votes, -1).argmax(axis=1)  # first max = the most recent match's token
        tok = t[ar, pick]
        any_row = np.asarray(has.any(axis=1))
        chain[:, d] = np.where(any_row, tok, _EMPTY)
        alive = has & (t == tok[:, None]) & any_row[:, None]
    drafted = (chain >= 0).sum(axis=1)
    width = 1 + int(drafted.max(initial=0))
    idx = np.arange(width)[None, :]
    counts = 1 + drafted
    tokens = np.zeros((bsz, width), dtype=np.int64)
    tokens[:, 0] = roots
    tokens[:, 1:] = np.where(chain[:, : width - 1] >= 0, chain[:, : width - 1], 0)
    parents = np.where(idx < counts[:, None], idx - 1, -1)
    return tokens, parents, counts


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


def _trees(roots: np.ndarray, conts: np.ndarray, alive: np.ndarray, topk: int,
           budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tree per row: a trie of the matches' continuations, topk children per node, pruned to the budget."""
    rows: list[tuple[list[int], list[int]]] = []
    for b in range(roots.shape[0]):
        trie = _Trie()
        for i in np.flatnonzero(alive[b]).tolist():
            c = conts[b, i]
            trie.add(c[c >= 0].tolist())
        new_index = {0: 0}
        toks, pars = [int(roots[b])], [-1]
        for i in trie.select(topk, budget):
            new_index[i] = len(toks)
            toks.append(trie.tokens[i])
            pars.append(new_index[trie.parents[i]])
        rows.append((toks, pars))
    width = max((len(t) for t, _ in rows), default=1)
    tokens = np.array([t + [0] * (width - len(t)) for t, _ in rows], dtype=np.int64).reshape(len(rows), width)
    parents = np.array([p + [-1] * (width - len(p)) for _, p in rows], dtype=np.int64).reshape(len(rows), width)
    counts = np.array([len(t) for t, _ in rows], dtype=np.int64)
    return tokens, parents, counts
