"""`tree_draft`: EAGLE-2 top-k tree expansion for the EAGLE proposer (`DraftContext.topk > 1`), eager.

Each level feeds the `topk` best frontier nodes (by cumulative log q) through the drafter; every node attends to the
context and its own ancestors; `speculative/proposers/draft_tree.topk_tree` prunes the expanded levels to `max_nodes` (deterministic
drafts, draft_probs None).

Run the tests: `python -m pytest tests/drafter/test_drafter_proposer.py -q`.
"""

from __future__ import annotations

import torch

from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.speculative.drafter.model import DraftKV, EagleDrafter
from worker.tlt.speculative.proposers.draft_tree import topk_tree


@torch.no_grad()
def tree_draft(
    drafter: EagleDrafter,
    root: torch.Tensor,  # [B] the root token of each row
    o: torch.Tensor,  # [B, 1, H] the drafter's output at the root (its context forward's last entry)
    kv: DraftKV,  # drafter K/V of the context entries
    valid: torch.Tensor,  # [B, W] bool, context entries with features
    last_pos: torch.Tensor,  # [B] RoPE position of the root entry
    topk: int,  # children per frontier node and frontier width
    max_depth: int,  # levels below the root
    max_nodes: int,  # node budget of the pruned tree, root included
) -> DraftProposal:
    d, k = drafter, topk
    bsz = root.shape[0]
    dev = root.device
    lp = torch.log_softmax(d.logits(o[:, 0]).float(), -1)  # [B, V]
    lp0, tok0 = lp.topk(k, dim=-1)  # [B, k]
    lv_tok, lv_par, lv_lp = [tok0], [torch.zeros_like(tok0)], [lp0]
    front_tok, front_score = tok0, lp0  # [B, k]
    front_hidden = o.expand(bsz, k, o.shape[-1])  # [B, k, H] the parent's output
    front_anc = torch.zeros(bsz, k, 0, dtype=torch.bool, device=dev)  # [B, k, E] ancestors among draft entries
    front_idx = torch.arange(k, device=dev).expand(bsz, k)  # index of each frontier node in its level
    eye = torch.eye(k, dtype=torch.bool, device=dev).expand(bsz, k, k)
    for level in range(1, max_depth):
        e = front_anc.shape[2]
        mask = torch.cat([valid[:, None, :].expand(bsz, k, valid.shape[1]), front_anc, eye], dim=2)
        pos = (last_pos + level)[:, None].expand(bsz, k)
        out, kv = d.step(front_tok, front_hidden, pos, kv, mask)  # [B, k, H]
        clp = torch.log_softmax(d.logits(out).float(), -1)  # [B, k, V]
        c_lp, c_tok = clp.topk(k, dim=-1)  # [B, k, k]
        parents = front_idx[:, :, None].expand(bsz, k, k).reshape(bsz, k * k)
        lv_tok.append(c_tok.reshape(bsz, k * k))
        lv_par.append(parents)
        lv_lp.append(c_lp.reshape(bsz, k * k))
        score = (front_score[:, :, None] + c_lp).reshape(bsz, k * k)
        best = score.topk(k, dim=-1).indices  # [B, k] indices into this level's k*k candidates
        pf = best // k  # frontier node (0..k-1) that is the parent
        own = torch.zeros(bsz, k, k, dtype=torch.bool, device=dev)
        own.scatter_(2, pf[:, :, None], True)  # the parent's own entry among this level's k new entries
        front_anc = torch.cat([front_anc.gather(1, pf[:, :, None].expand(bsz, k, e)), own], dim=2)
        front_tok = c_tok.reshape(bsz, k * k).gather(1, best)
        front_score = score.gather(1, best)
        front_hidden = out.gather(1, pf[:, :, None].expand(bsz, k, out.shape[-1]))
        front_idx = best
    return topk_tree(root, lv_tok, lv_par, lv_lp, budget=max_nodes)
