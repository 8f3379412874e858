"""`EagleProposer`: the EAGLE drafter as a spec `Proposer` (chain of k tokens or an EAGLE-2 top-k tree).

Where the target features come from: the engine's hidden hook (`Engine(hidden_hook=...)`, called with the hidden
state of every position whose K/V entered the cache) also feeds `observe(seq_ids, token_ids, hidden)`, which keeps
the last `context` feature rows of each sequence in one preallocated device ring (one index_copy per call). When a
`DraftContext` carries `hidden`/`hidden_lens` itself, those are used instead.

Each `propose(ctx)` recomputes the drafter over the last `context` positions of every row (drafter entries
(x_{j+1}, h_j) at RoPE position j, the last one being (root, h_{L-1})), so nothing drafter-side has to be rolled back
after verification; then it drafts with a drafter-side K/V of the draft entries:
- chain (`topk == 1`): k = min(max_depth, max_nodes - 1) tokens; rows with temperature > 0 sample each token from the
  drafter's processed distribution (same temperature / top-p / top-k as the target row) and hand those q rows to the
  verifier; greedy rows take the argmax (one-hot q, exact either way);
- tree (`topk > 1`): EAGLE-2 expansion, each level feeds the `topk` best frontier nodes (by cumulative log q), every
  node attends to the context and its own ancestors; `spec.tree.topk_tree` prunes to ctx.max_nodes (deterministic
  drafts, draft_probs None).
Weights come from the spot trainer as versioned snapshots, loaded at rollout start (`load_snapshot`), never mid-rollout.

Run the tests: `python -m pytest tests/drafter/test_drafter_proposer.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.tlt.drafter.model import DraftKV, EagleDrafter
from worker.tlt.drafter.train import DrafterSnapshot
from worker.tlt.spec.proposer import DraftContext
from worker.tlt.spec.sampling import processed_probs, sample
from worker.tlt.spec.tree import chain_proposal, topk_tree
from worker.tlt.spec.types import DraftProposal

SeqId = tuple[int, int]  # (group / request, sample)


@dataclass(frozen=True)
class EagleProposerConfig:
    topk: int = 1  # 1 = chain; > 1 = top-k tree (EAGLE-2), pruned to ctx.max_nodes
    context: int = 64  # drafter positions recomputed per propose (the drafter's attention window)
    max_seqs: int = 1024  # sequences whose feature rings fit (grows on demand)
    seed: int = 0  # generator for sampled chain drafts


class EagleProposer:
    def __init__(self, drafter: EagleDrafter, config: EagleProposerConfig | None = None) -> None:
        self.drafter = drafter.eval()
        self.config = config or EagleProposerConfig()
        self.device = next(drafter.parameters()).device
        self.version = 0  # snapshot version loaded
        self.gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self._ring = torch.zeros(0, self.config.context, drafter.feature_dim, device=self.device)  # [S, W, F]
        self._slot: dict[SeqId, int] = {}
        self._count: list[int] = []  # rows ever written per slot

    # ------------------------------------------------------------------------------------------------ weights
    def load_snapshot(self, snap: DrafterSnapshot) -> bool:
        """Load newer weights (call at rollout start); False when `snap` is not newer than what is loaded."""
        if snap.version <= self.version:
            return False
        self.drafter.load_state_dict(snap.state, strict=True)
        self.version = snap.version
        return True

    def reset(self) -> None:
        self._slot.clear()
        self._count.clear()

    # ------------------------------------------------------------------------------------------------ features
    def observe(
        self,
        seq_ids: Sequence[SeqId],  # [N] sequence of each row
        token_ids: torch.Tensor,  # [N] (unused: the context tokens come from the histories)
        hidden: torch.Tensor,  # [N, F] target feature of each row, rows of a sequence in position order
    ) -> None:
        """The engine hook: remember the last `context` features of each sequence."""
        n = len(seq_ids)
        if n == 0:
            return
        w = self.config.context
        flat: list[int] = []
        for sid in seq_ids:
            slot = self._slot.get(sid)
            if slot is None:
                slot = self._slot[sid] = len(self._count)
                self._count.append(0)
            flat.append(slot * w + self._count[slot] % w)
            self._count[slot] += 1
        need = len(self._count)
        if need > self._ring.shape[0]:
            grown = torch.zeros(max(need, 2 * self._ring.shape[0], 64), w, self._ring.shape[2], device=self.device)
            grown[: self._ring.shape[0]] = self._ring
            self._ring = grown
        idx = torch.tensor(flat, device=self.device)
        # later rows win on duplicate ring cells (a sequence writing more than `context` rows in one call)
        self._ring.view(-1, self._ring.shape[2]).index_copy_(0, idx, hidden.detach().to(self.device, torch.float32))

    def _context(self, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> tokens [B, W] (x_{j+1}), features [B, W, F] (h_j), valid entries per row [B]; right-aligned."""
        w = self.config.context
        bsz = ctx.batch_size
        toks = torch.zeros(bsz, w, dtype=torch.int64)
        if ctx.hidden is not None and ctx.hidden_lens is not None:
            t = ctx.hidden.shape[1]
            feats = ctx.hidden[:, -w:].to(self.device, torch.float32)
            if t < w:
                feats = torch.nn.functional.pad(feats, (0, 0, w - t, 0))
            m = ctx.hidden_lens.to(self.device).clamp_max(w)
            m_host = m.tolist()
        else:
            m_host, gather = [], []
            for b in range(bsz):
                slot = self._slot.get((ctx.group_ids[b], ctx.sample_ids[b]))
                cnt = self._count[slot] if slot is not None else 0
                mb = min(cnt, w, len(ctx.histories[b]) - 1)
                m_host.append(mb)
                base = (slot or 0) * w
                gather.append([base + (cnt - w + i) % w if i >= w - mb else 0 for i in range(w)])
            feats = self._ring.view(-1, self._ring.shape[2])[torch.tensor(gather, device=self.device)]
            m = torch.tensor(m_host, device=self.device)
        for b in range(bsz):
            mb = m_host[b]
            if mb:
                toks[b, w - mb:] = torch.tensor(list(ctx.histories[b][-mb:]), dtype=torch.int64)
        return toks.to(self.device), feats, m

    # ------------------------------------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftProposal:
        d = self.drafter
        w = self.config.context
        root = ctx.roots().to(self.device)
        toks, feats, m = self._context(ctx)
        hist_len = torch.tensor([len(h) for h in ctx.histories], device=self.device)
        col = torch.arange(w, device=self.device)
        valid = col[None, :] >= (w - m)[:, None]  # [B, W]
        last_pos = hist_len - 2  # position j of the last entry (root, h_{L-1}), L = len(history) - 1
        pos = (last_pos[:, None] - (w - 1) + col[None, :]).clamp_min(0)  # [B, W]
        mask = torch.tril(torch.ones(w, w, dtype=torch.bool, device=self.device))[None] & valid[:, None, :]
        mask = mask | torch.eye(w, dtype=torch.bool, device=self.device)[None]  # padded entries attend to themselves
        out, kv = d.step(toks, feats, pos, None, mask)
        o_root = out[:, -1:]  # [B, 1, H]
        has_ctx = m > 0
        if self.config.topk <= 1:
            prop = self._chain(ctx, root, o_root, kv, valid, last_pos)
        else:
            prop = self._tree(ctx, root, o_root, kv, valid, last_pos)
        if bool((~has_ctx).any()):  # rows without features yet: root only (plain decoding for that row)
            keep = has_ctx[:, None] | (torch.arange(prop.num_nodes, device=self.device)[None, :] == 0)
            prop = DraftProposal(
                tokens=prop.tokens, parents=torch.where(keep, prop.parents, -1),
                counts=torch.where(has_ctx, prop.counts, 1), draft_probs=prop.draft_probs,
            )
        return prop

    def _chain(self, ctx: DraftContext, root: torch.Tensor, o: torch.Tensor, kv: DraftKV, valid: torch.Tensor,
               last_pos: torch.Tensor) -> DraftProposal:
        d = self.drafter
        k = max(0, min(ctx.max_depth, ctx.max_nodes - 1))
        sp = ctx.sampling
        use_q = sp is not None and bool((sp.temperature > 0).any())
        drafts, qs = [], []
        past_mask = valid  # [B, P] entries every draft attends to
        for step in range(k):
            logits = d.logits(o[:, 0]).float()  # [B, V]
            if use_q:
                assert sp is not None
                q = processed_probs(logits, sp.temperature, sp.top_p, sp.top_k)
                tok = sample(q, self.gen)
                qs.append(q)
            else:
                tok = logits.argmax(-1)
            drafts.append(tok)
            if step + 1 == k:
                break
            past_mask = torch.cat([past_mask, torch.ones_like(past_mask[:, :1])], dim=1)
            pos = (last_pos + 1 + step)[:, None]
            o, kv = d.step(tok[:, None], o, pos, kv, past_mask[:, None, :])
        dr = torch.stack(drafts, 1) if drafts else root.new_zeros(root.shape[0], 0)
        return chain_proposal(root, dr, torch.stack(qs, 1) if qs else None)

    def _tree(self, ctx: DraftContext, root: torch.Tensor, o: torch.Tensor, kv: DraftKV, valid: torch.Tensor,
              last_pos: torch.Tensor) -> DraftProposal:
        d = self.drafter
        k = self.config.topk
        bsz = root.shape[0]
        dev = self.device
        lp = torch.log_softmax(d.logits(o[:, 0]).float(), -1)  # [B, V]
        lp0, tok0 = lp.topk(k, dim=-1)  # [B, k]
        lv_tok, lv_par, lv_lp = [tok0], [torch.zeros_like(tok0)], [lp0]
        front_tok, front_score = tok0, lp0  # [B, k]
        front_hidden = o.expand(bsz, k, o.shape[-1])  # [B, k, H] the parent's output
        front_anc = torch.zeros(bsz, k, 0, dtype=torch.bool, device=dev)  # [B, k, E] ancestors among draft entries
        front_idx = torch.arange(k, device=dev).expand(bsz, k)  # index of each frontier node in its level
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(bsz, k, k)
        for level in range(1, ctx.max_depth):
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
        return topk_tree(root, lv_tok, lv_par, lv_lp, budget=ctx.max_nodes)
