"""The verifier: accept a draft chain or tree against the target, exactly (lossless), in one pass over its depth.

Inputs: a `DraftProposal` (decoding/draft_types.py) and the target's outputs for its N nodes from one verify forward; target row i is
the target's distribution of the token FOLLOWING node i (row 0: after the root, i.e. after the last emitted token).
Per sequence the verifier walks the tree from the root and returns (`VerifyResult`):

- **accepted** tokens: draft nodes on one root-to-node path that the rule below accepted, in order;
- one **recovered** token: when all children of the last accepted node were rejected, a token sampled from the
  residual distribution left by those rejections (greedy: the target's argmax); or
- one **bonus** token: when the last accepted node has no children (the whole path was accepted), a token sampled
  from the target row of that node (greedy: its argmax).

So every sequence emits between 1 and D+1 tokens per step (D = tree depth), and `accepted_nodes` lists the nodes whose
KV entries the engine keeps (`tokens` and `accepted_nodes` have D+1 columns, D = max_depth or the proposal's depth;
`accepted_nodes` never uses its last column). Passing `max_depth` / `max_children` avoids the verifier's one host
sync; a `max_depth` below the tree's depth stops the walk there and samples the bonus from that node (still exact).
EOS / max_new_tokens truncation inside the emitted run is left to the engine
(`truncate_emitted` helps).

Greedy (`verify_greedy`): accept a child whose token equals argmax of the target row of its parent (the first such
child in index order); emitted tokens are then exactly the target's greedy continuation.

Sampling (`verify_sampling`), on the processed target distribution p (sampling.processed_probs, the same one plain
decoding samples from) — speculative sampling of Leviathan, Kalman & Matias 2023 ("Fast Inference from Transformers
via Speculative Decoding") and Chen et al. 2023 ("Accelerating Large Language Model Decoding with Speculative
Sampling"), extended to several children per node as multi-round rejection (SpecInfer, Miao et al. 2024; EAGLE):
at the current node, with target p and drafter q (the proposal's draft_probs row of that node), try the children
x_1, x_2, ... in index order: accept x_i with probability min(1, p(x_i) / q(x_i)); on rejection replace
p <- norm(max(0, p - q)) and, because siblings are distinct draws *without replacement* from q,
q <- norm(q with x_i removed); if all are rejected, sample the recovered token from the final p.
Deterministic drafters (draft_probs None: n-gram, top-k trees) have q = one-hot(x_i): accept with probability p(x_i),
on rejection zero p(x_i) and renormalise. Why it is exact: at each round, P(emit y) = min(p(y), q(y)) +
P(reject) * residual(y) = p(y) given the history, and the next round's target does not depend on which token was
drawn, so by induction the emitted token is distributed as p whatever the number of children; a chain is the case of
one child per node, where this is exactly Leviathan et al.'s rule. Requirement for draft_probs trees: the children of
a node are sampled sequentially without replacement from its draft_probs row (a chain: one sample), independently of
the verifier's randomness. Log-probs returned are those of the emitted tokens under the unmodified p (rows of
target_probs), i.e. what plain decoding would report.

Run the tests: `python -m pytest tests/spec -q`.
"""

from __future__ import annotations

import torch

from worker.tlt.decoding.draft_types import DraftProposal, VerifyResult
from worker.tlt.decoding.sampling import exponential_noise, pick_with_noise
from worker.tlt.speculative.proposers.draft_tree import children_table, node_depths

_TINY = 1e-30


def _accept(u: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:  # [B] each -> [B] bool
    """Accept with probability min(1, p(x) / q(x)) (p, q normalised); written without a division."""
    return u * q_x < p_x


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # [B, V], [B, V] -> [B, V]
    """norm(max(0, p - q)); where that is all zero (p == q, a rejection of probability 0), p itself."""
    r = (p - q).clamp_min(0.0)
    s = r.sum(dim=-1, keepdim=True)
    return torch.where(s > _TINY, r / s.clamp_min(_TINY), p)


def _row(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # t [B, N, V], idx [B, 1] -> [B, V] = t[b, idx[b]]
    return t.gather(1, idx.unsqueeze(2).expand(-1, 1, t.shape[2])).squeeze(1)


def _put(dst: torch.Tensor, col: torch.Tensor, val: torch.Tensor, where: torch.Tensor) -> None:
    """dst[b, col[b]] = val[b] where where[b] (all [B, 1]); in place, no host sync."""
    dst.scatter_(1, col, torch.where(where, val.to(dst.dtype), dst.gather(1, col)))


def _structure(proposal: DraftProposal, max_depth: int | None, max_children: int | None) -> tuple[int, torch.Tensor]:
    depth_bound = max_depth
    if depth_bound is None:
        depth_bound = int(node_depths(proposal.parents).max().item()) if proposal.num_nodes > 1 else 0
    children = children_table(proposal.parents, proposal.counts, max_children)  # [B, N, K]
    return depth_bound, children


def verify_greedy(
    proposal: DraftProposal,
    target_logits: torch.Tensor,  # [B, N, V] target logits at the proposal's nodes
    max_depth: int | None = None,  # bound on the tree depth (saves a host sync); a smaller one caps acceptance
    max_children: int | None = None,  # optional known max children per node (saves a host sync)
) -> VerifyResult:
    """Greedy acceptance; logprobs are log_softmax(target_logits) of the emitted tokens (the processed greedy
    distribution is a one-hot, which says nothing)."""
    bsz, n, _ = target_logits.shape
    device = target_logits.device
    depth, children = _structure(proposal, max_depth, max_children)
    width = children.shape[2]
    argmax = target_logits.argmax(dim=-1)  # [B, N] first index on ties, as processed_probs' greedy one-hot
    lse = torch.logsumexp(target_logits.float(), dim=-1)  # [B, N] (log-probs of emitted tokens only, no [B, N, V])
    cur = torch.zeros(bsz, 1, dtype=torch.int64, device=device)  # [B, 1] current node
    out = torch.zeros(bsz, depth + 1, dtype=torch.int64, device=device)
    lps = torch.zeros(bsz, depth + 1, device=device)
    acc_nodes = torch.full((bsz, depth + 1), -1, dtype=torch.int64, device=device)
    n_acc = torch.zeros(bsz, 1, dtype=torch.int64, device=device)
    active = torch.ones(bsz, 1, dtype=torch.bool, device=device)
    for _ in range(depth):
        want = argmax.gather(1, cur)  # [B, 1]
        kids = children.gather(1, cur.unsqueeze(2).expand(-1, 1, width)).squeeze(1)  # [B, K]
        match = (kids >= 0) & (proposal.tokens.gather(1, kids.clamp_min(0)) == want)
        found = match.any(dim=1, keepdim=True) & active
        first = kids.gather(1, match.to(torch.int64).argmax(dim=1, keepdim=True))  # first matching child
        nxt = torch.where(found, first, cur)
        _put(out, n_acc, want, found)
        _put(lps, n_acc, _logprob(target_logits, lse, cur, want), found)
        _put(acc_nodes, n_acc, nxt, found)
        n_acc = n_acc + found.to(torch.int64)
        cur = nxt
        active = found
    final = argmax.gather(1, cur)
    everyone = torch.ones_like(active)
    _put(out, n_acc, final, everyone)
    _put(lps, n_acc, _logprob(target_logits, lse, cur, final), everyone)
    return VerifyResult(tokens=out, num_emitted=n_acc.squeeze(1) + 1, accepted_nodes=acc_nodes, logprobs=lps)


def _logprob(logits: torch.Tensor, lse: torch.Tensor, node: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[b, node[b], tok[b]] from logits [B, N, V] and lse [B, N]; node, tok [B, 1]."""
    return _row(logits, node).gather(1, tok).float() - lse.gather(1, node)


def verify_sampling(
    proposal: DraftProposal,
    target_probs: torch.Tensor,  # [B, N, V] processed target distributions at the proposal's nodes
    generator: torch.Generator | None = None,
    max_depth: int | None = None,  # bound on the tree depth (saves a host sync); a smaller one caps acceptance
    max_children: int | None = None,  # optional known max children per node (saves a host sync)
    uniforms: torch.Tensor | None = None,  # [B, >= depth * width] pre-drawn U(0, 1) (None: drawn here)
    noise: torch.Tensor | None = None,  # [B, V] pre-drawn Exp(1) for the final token (None: drawn here)
) -> VerifyResult:
    """Exact speculative sampling over a chain or tree (module docstring). Rows whose target is a one-hot
    (temperature 0) reduce to greedy acceptance, so one call serves a batch that mixes settings. The randomness
    (one uniform per tried child, one Exp(1) vector per row) may come pre-drawn, e.g. refilled static buffers of a
    CUDA graph; it must be fresh i.i.d. draws for every call."""
    bsz, n, _ = target_probs.shape
    device = target_probs.device
    target_probs = target_probs.float()
    depth, children = _structure(proposal, max_depth, max_children)
    width = children.shape[2]
    if uniforms is None:
        uniforms = torch.rand(bsz, max(depth * width, 1), device=device, generator=generator)
    if noise is None:
        noise = exponential_noise(target_probs[:, 0], generator)
    q_all = proposal.draft_probs
    cur = torch.zeros(bsz, 1, dtype=torch.int64, device=device)  # [B, 1] current node
    active = torch.ones(bsz, 1, dtype=torch.bool, device=device)
    out = torch.zeros(bsz, depth + 1, dtype=torch.int64, device=device)
    lps = torch.zeros(bsz, depth + 1, device=device)
    acc_nodes = torch.full((bsz, depth + 1), -1, dtype=torch.int64, device=device)
    n_acc = torch.zeros(bsz, 1, dtype=torch.int64, device=device)
    p = target_probs[:, 0].clone()  # [B, V] current (residual) target at the current node
    for d in range(depth):
        q = None if q_all is None else _row(q_all, cur).float()  # [B, V]
        if q is not None:
            q = q / q.sum(dim=-1, keepdim=True).clamp_min(_TINY)
        kids = children.gather(1, cur.unsqueeze(2).expand(-1, 1, width)).squeeze(1)  # [B, K]
        moved = torch.zeros(bsz, 1, dtype=torch.bool, device=device)
        nxt = cur
        for j in range(width):
            child = kids[:, j : j + 1]  # [B, 1]
            trying = active & ~moved & (child >= 0)
            x = proposal.tokens.gather(1, child.clamp_min(0))  # [B, 1]
            p_x = p.gather(1, x)
            if q is None:
                q_x = torch.ones_like(p_x)
                q_step = torch.zeros_like(p).scatter_(1, x, 1.0)
            else:
                q_x = q.gather(1, x)
                q_step = q
            u = uniforms[:, d * width + j : d * width + j + 1]
            ok = trying & _accept(u, p_x, q_x)
            rejected = trying & ~ok
            moved = moved | ok
            nxt = torch.where(ok, child, nxt)
            p = torch.where(rejected, _residual(p, q_step), p)
            if q is not None:  # the next sibling was drawn from q without this token
                q_wo = q.scatter(1, x, 0.0)
                q = torch.where(rejected, q_wo / q_wo.sum(dim=-1, keepdim=True).clamp_min(_TINY), q)
        # rows that moved emit the accepted child; rows that stopped keep their residual in p (frozen from now on)
        tok = proposal.tokens.gather(1, nxt)  # [B, 1]
        new_p = _row(target_probs, nxt)  # [B, V] target after the accepted child
        _put(out, n_acc, tok, moved)
        _put(lps, n_acc, _row(target_probs, cur).gather(1, tok).log(), moved)
        _put(acc_nodes, n_acc, nxt, moved)
        n_acc = n_acc + moved.to(torch.int64)
        cur = nxt
        p = torch.where(moved, new_p, p)
        active = moved
    # one draw per row from its final distribution: the residual where it stopped (recovered token) or, for rows
    # whose walk ended at a leaf or at max_depth, the untouched target row of that node (bonus token)
    drawn = pick_with_noise(p, noise).unsqueeze(1)  # [B, 1]
    everyone = torch.ones_like(active)
    _put(out, n_acc, drawn, everyone)
    _put(lps, n_acc, _row(target_probs, cur).gather(1, drawn).log(), everyone)
    n_acc = n_acc.squeeze(1)
    return VerifyResult(tokens=out, num_emitted=n_acc + 1, accepted_nodes=acc_nodes, logprobs=lps)


def truncate_emitted(
    result: VerifyResult,
    eos_ids: torch.Tensor,  # [E] int64 stop tokens (may be empty)
    remaining: torch.Tensor,  # [B] int64 new tokens each sequence may still emit (>= 1)
) -> tuple[torch.Tensor, torch.Tensor]:  # num_emitted [B] after cutting, finished [B] bool
    """Cut each emitted run after its first EOS and at the max_new_tokens budget; `finished` marks sequences that
    hit either. Accepted nodes past the new length must be rolled back like rejected ones."""
    bsz, width = result.tokens.shape
    pos = torch.arange(width, device=result.tokens.device).expand(bsz, width)
    in_run = pos < result.num_emitted.unsqueeze(1)
    is_eos = torch.isin(result.tokens, eos_ids.to(result.tokens.device)) & in_run
    first_eos = torch.where(is_eos, pos, width).min(dim=1).values  # width when none
    n = torch.minimum(result.num_emitted, first_eos + 1)
    n = torch.minimum(n, remaining.to(n.dtype))
    finished = (first_eos < n) | (n >= remaining)
    return n, finished
