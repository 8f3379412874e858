"""Draft-tree geometry and builders: depths, the tree attention mask, child tables, chain and top-k trees.

A proposal (types.DraftProposal) is a forest of B trees in parent-pointer form: node 0 is the root (the last emitted
token), every other valid node has a parent with a smaller index, nodes >= counts[b] are padding (parent -1).

- `node_depths(parents)`: depth of each node (0 for the root and for padding) = the position offset at which the
  target sees it (root at the sequence's current length - 1, a depth-d node at that + d);
- `ancestor_mask(parents)`: [B, N, N] bool, True where node i may attend to node j (j is i or an ancestor of i);
  the target's verify forward combines it with the causal mask over the cached prefix;
- `children_table(parents, counts)`: [B, N, K] child indices of each node in index order (-1 padding), what the
  verifier walks;
- `chain_proposal(...)`: a chain of k drafted tokens (per-row lengths allowed), optionally with drafter probs;
- `topk_tree(...)`: EAGLE-2-style tree from a drafter's per-depth top-k candidates, pruned to the verify budget by
  cumulative log-probability.

Run the tests: `python -m pytest tests/spec/test_spec_tree.py -q`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from worker.tlt.decoding.draft_types import DraftProposal


def valid_nodes(counts: torch.Tensor, num_nodes: int) -> torch.Tensor:  # counts [B] -> [B, N] bool
    return torch.arange(num_nodes, device=counts.device).unsqueeze(0) < counts.unsqueeze(1)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:  # parents [B, N] int64 -> [B, N, N] bool
    """mask[b, i, j] is True iff node j is node i or one of its ancestors (pointer jumping: log2(N) gathers)."""
    bsz, n = parents.shape
    cols = torch.arange(n, device=parents.device).view(1, 1, n)
    reach = (cols == torch.arange(n, device=parents.device).view(1, n, 1)) | (parents.unsqueeze(-1) == cols)
    jump = parents  # [B, N] the 2^s-th ancestor of each node after s rounds (-1: none)
    for _ in range(math.ceil(math.log2(max(n - 1, 1)))):  # reach covers distance <= 2^rounds
        has = (jump >= 0).unsqueeze(-1)
        target = jump.clamp_min(0)
        reach = reach | (reach.gather(1, target.unsqueeze(-1).expand(bsz, n, n)) & has)
        jump = torch.where(jump >= 0, jump.gather(1, target), jump)
    return reach


def node_depths(parents: torch.Tensor) -> torch.Tensor:  # parents [B, N] -> [B, N] int64
    """Depth of each node: 0 for the root (and for padding, whose parent is -1)."""
    return depths_from_ancestors(ancestor_mask(parents))


def depths_from_ancestors(anc: torch.Tensor) -> torch.Tensor:  # ancestor_mask [B, N, N] -> [B, N] int64
    """node_depths from an ancestor mask already at hand (a node's ancestors-or-self, less itself)."""
    return anc.sum(dim=-1).to(torch.int64) - 1


def children_table(
    parents: torch.Tensor,  # [B, N] int64
    counts: torch.Tensor,  # [B] int64
    max_children: int | None = None,  # width K; None computes it (one host sync)
) -> torch.Tensor:  # [B, N, K] int64 child node indices in increasing index order, -1 padding
    bsz, n = parents.shape
    valid = valid_nodes(counts, n) & (parents >= 0)
    same = (parents.unsqueeze(1) == parents.unsqueeze(2)) & valid.unsqueeze(1) & valid.unsqueeze(2)  # [B, N, N]
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)  # j < i
    rank = (same & earlier).sum(dim=-1)  # [B, N] position of node i among its parent's children
    if max_children is None:
        max_children = int(rank.masked_fill(~valid, -1).max().item()) + 1 if bool(valid.any()) else 0
    table = torch.full((bsz, n * max(max_children, 1) + 1), -1, dtype=torch.int64, device=parents.device)
    slot = torch.where(valid & (rank < max_children), parents.clamp_min(0) * max_children + rank, n * max_children)
    node = torch.arange(n, device=parents.device).expand(bsz, n)
    table.scatter_(1, slot, torch.where(slot < n * max_children, node, -1))
    return table[:, : n * max_children].view(bsz, n, max_children)


def chain_proposal(
    root: torch.Tensor,  # [B] int64 last emitted token of each sequence
    drafts: torch.Tensor,  # [B, k] int64 drafted tokens
    draft_probs: torch.Tensor | None = None,  # [B, k, V] q that sampled drafts[:, j] (None: deterministic drafter)
    num_drafts: torch.Tensor | None = None,  # [B] int64 valid drafts per row (<= k); None = all k
) -> DraftProposal:
    """A chain: node j+1 holds drafts[:, j] and its parent is node j."""
    bsz, k = drafts.shape
    device = drafts.device
    tokens = torch.cat([root.view(bsz, 1).to(torch.int64), drafts.to(torch.int64)], dim=1)
    counts = torch.full((bsz,), k + 1, dtype=torch.int64, device=device)
    if num_drafts is not None:
        counts = num_drafts.to(device=device, dtype=torch.int64).clamp(0, k) + 1
    idx = torch.arange(k + 1, device=device).expand(bsz, k + 1)
    parents = torch.where(idx < counts.unsqueeze(1), idx - 1, torch.full_like(idx, -1))
    probs = None
    if draft_probs is not None:
        # row i of DraftProposal.draft_probs is the q that sampled node i's child: shift by one, zero row at the end
        probs = torch.cat([draft_probs.float(), draft_probs.new_zeros(bsz, 1, draft_probs.shape[-1]).float()], dim=1)
    return DraftProposal(tokens=tokens, parents=parents, counts=counts, draft_probs=probs)


def topk_tree(
    root: torch.Tensor,  # [B] int64
    level_tokens: Sequence[torch.Tensor],  # per depth d: [B, M_d] candidate tokens
    level_parents: Sequence[torch.Tensor],  # per depth d: [B, M_d] index into level d-1's candidates (ignored at d=0)
    level_logprobs: Sequence[torch.Tensor],  # per depth d: [B, M_d] drafter log q(token | parent path); -inf = none
    budget: int,  # verify budget: nodes per row including the root
) -> DraftProposal:
    """Keep the budget-1 candidates with the highest cumulative log-probability (EAGLE-2's reranking).

    Log-probs are clamped to <= 0, so a node never outscores its parent; ties go to the shallower / earlier candidate
    (stable sort), so the kept set is closed under ancestors. Output nodes keep breadth-first order (parents first),
    children of a node in order of their drafter score, which is the order the verifier tries them in. Deterministic
    drafts: draft_probs is None (the verifier's one-hot rule is exact for any draft chosen without the target)."""
    bsz = root.shape[0]
    device = root.device
    toks, pars, scores = [], [], []
    offset = 1  # global index of the first candidate of the current level (root = 0)
    prev_scores = torch.zeros(bsz, 1, device=device)
    prev_offset = 0
    for d, (t, p, lp) in enumerate(zip(level_tokens, level_parents, level_logprobs, strict=True)):
        lp = lp.float().clamp(max=0.0).nan_to_num(nan=float("-inf"))
        local_parent = torch.zeros_like(t, dtype=torch.int64) if d == 0 else p.to(torch.int64)
        s = prev_scores.gather(1, local_parent) + lp
        toks.append(t.to(torch.int64))
        pars.append(local_parent + prev_offset)
        scores.append(s)
        prev_scores, prev_offset = s, offset
        offset += t.shape[1]
    if not toks:
        return chain_proposal(root, torch.zeros(bsz, 0, dtype=torch.int64, device=device))
    all_tok = torch.cat(toks, dim=1)  # [B, T]
    all_par = torch.cat(pars, dim=1)  # [B, T] global index (root 0, candidates 1..T)
    all_score = torch.cat(scores, dim=1)  # [B, T]
    # rank within each node's siblings by score, so the kept nodes come out parents-first and best child first
    keep = min(max(budget - 1, 0), all_tok.shape[1])
    order = torch.sort(all_score, dim=1, descending=True, stable=True).indices[:, :keep]  # [B, keep]
    kept_valid = torch.isfinite(all_score.gather(1, order))
    # restore breadth-first order among kept nodes: sort by level (global index), siblings by score rank
    level_of = torch.cat([torch.full_like(t, d) for d, t in enumerate(toks)], dim=1)
    rank = torch.arange(keep, device=device).expand(bsz, keep)
    key = torch.where(kept_valid, level_of.gather(1, order) * (keep + 1) + rank, torch.full_like(rank, 1 << 40))
    order = order.gather(1, torch.sort(key, dim=1).indices)
    kept_valid = torch.isfinite(all_score.gather(1, order))
    new_index = torch.full((bsz, all_tok.shape[1] + 1), -1, dtype=torch.int64, device=device)
    new_index[:, 0] = 0
    new_index.scatter_(
        1, order + 1, torch.where(kept_valid, torch.arange(1, keep + 1, device=device), -1).expand(bsz, -1)
    )
    tokens = torch.cat([root.view(bsz, 1).to(torch.int64), all_tok.gather(1, order)], dim=1)
    parents = torch.cat(
        [torch.full((bsz, 1), -1, dtype=torch.int64, device=device), new_index.gather(1, all_par.gather(1, order))],
        dim=1,
    )
    parents[:, 1:] = torch.where(kept_valid, parents[:, 1:], -1)
    counts = 1 + kept_valid.sum(dim=1)
    return DraftProposal(tokens=tokens, parents=parents, counts=counts, draft_probs=None)


def validate_proposal(proposal: DraftProposal, max_nodes: int | None = None, max_depth: int | None = None) -> None:
    """Raise ValueError if the proposal breaks types.DraftProposal's invariants or the budgets (syncs: for tests and
    debugging, not the hot path)."""
    tokens, parents, counts = proposal.tokens, proposal.parents, proposal.counts
    bsz, n = tokens.shape
    if parents.shape != (bsz, n) or counts.shape != (bsz,):
        raise ValueError(
            f"shapes: tokens {tuple(tokens.shape)}, parents {tuple(parents.shape)}, counts {tuple(counts.shape)}"
        )
    if bool(((counts < 1) | (counts > n)).any()):
        raise ValueError("counts must be in 1..N")
    if bool((parents[:, 0] != -1).any()):
        raise ValueError("node 0 (the root) must have parent -1")
    valid = valid_nodes(counts, n)
    idx = torch.arange(n, device=parents.device).expand(bsz, n)
    inner = valid & (idx > 0)
    if bool((inner & ((parents < 0) | (parents >= idx))).any()):
        raise ValueError("every valid non-root node needs a parent with a smaller index")
    if bool((~valid & (parents != -1)).any()):
        raise ValueError("padding nodes must have parent -1")
    if max_nodes is not None and bool((counts > max_nodes).any()):
        raise ValueError(f"more than {max_nodes} nodes in a row")
    if max_depth is not None and n > 1 and int(node_depths(parents).max()) > max_depth:
        raise ValueError(f"tree deeper than {max_depth}")
    if proposal.draft_probs is not None and tuple(proposal.draft_probs.shape[:2]) != (bsz, n):
        raise ValueError(f"draft_probs must be [B, N, V], got {tuple(proposal.draft_probs.shape)}")
