"""Small-model drafter: any causal LM sharing the target's tokenizer (e.g. a smaller model of the same family)
drafts a chain of `depth` tokens or an EAGLE-2-style top-k tree, from its own KV cache.

It implements the engine's Proposer protocol (rollout/proposer_api.py) with its hooks: rows move with the engine's
rows (`move_rows`), new sequences reset their row (`on_admit`), and `observe` records how much of the drafted chain
was accepted, so the next `propose` only feeds the tokens the drafter has not seen ("catch-up"; the prompt on a
row's first step). Chains sample drafts from the drafter's processed distribution with the target's sampling
settings and hand those distributions to the verifier (exact speculative sampling); greedy rows and trees are
deterministic (draft_probs None, for which the verifier's rule is exact too).

    proposer = SmallModelProposer(draft_model)
    engine = Engine(target, eos_ids=..., spec=SpecConfig(mode="on", depth=4), proposer=proposer)
Run the tests: `python -m pytest tests/engine/test_engine_spec_greedy.py -q`.
"""

from __future__ import annotations

import torch

from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.kv_cache import KVCache
from worker.tlt.rollout.proposer_api import DraftContext
from worker.tlt.spec.sampling import processed_probs, sample
from worker.tlt.spec.tree import chain_proposal, topk_tree
from worker.tlt.spec.types import DraftProposal, VerifyResult


class SmallModelProposer:
    def __init__(self, model: Transformer) -> None:
        self.model = model.eval()
        self.device = model.head_weight.device
        self.cache: KVCache | None = None
        self.dlen = torch.zeros(0, dtype=torch.int64, device=self.device)  # [slots] drafter-cached prefix per row
        self._valid_end: torch.Tensor | None = None  # [B] cache valid up to here if every draft is accepted

    # ----------------------------------------------------------------------------------------------- hooks
    def reset(self, slots: int) -> None:
        self.dlen = torch.zeros(slots, dtype=torch.int64, device=self.device)

    def on_admit(self, row0: int, m: int) -> None:
        self.dlen[row0 : row0 + m] = 0

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:  # [M] int64 each
        if self.cache is not None:
            self.cache.move_rows(src, dst)
        self.dlen.index_copy_(0, dst, self.dlen.index_select(0, src))

    def observe(self, result: VerifyResult, ctx: DraftContext) -> None:
        assert self._valid_end is not None
        b = ctx.seq_lens.shape[0]
        accepted_end = ctx.seq_lens + result.num_emitted - 1  # root + accepted drafts are now known tokens
        self.dlen[:b] = torch.minimum(accepted_end, self._valid_end)

    # ------------------------------------------------------------------------------------------------ draft
    def _ensure_cache(self, ctx: DraftContext) -> int:
        need = ctx.tokens.shape[1] + ctx.spec.depth * max(ctx.spec.topk, 1) + 2
        if self.cache is None or self.cache.max_len < need or self.cache.slots < self.dlen.shape[0]:
            w = self.model.head_weight
            self.cache = KVCache.allocate(self.model.args, self.dlen.shape[0], need, w.device, w.dtype)
            self.dlen.zero_()
            if self.model.rope_cos.shape[0] < need:
                self.model.init_rope(w.device, need)
        return self.cache.max_len

    def _catch_up(self, ctx: DraftContext, t_len: int) -> torch.Tensor:  # -> logits after the root [B, V]
        """Feed each row's unseen tokens (dlen .. root) in one forward; one host sync for the widest gap."""
        assert self.cache is not None
        b = ctx.seq_lens.shape[0]
        dl = self.dlen[:b]
        gap = (ctx.seq_lens - dl).clamp_min(1)
        s = int(torch.where(ctx.active, gap, 1).max())
        i = torch.arange(s, device=self.device)
        valid = i[None, :] < gap[:, None]
        pos = torch.where(valid, dl[:, None] + i[None, :], t_len - 1)  # padding writes into the scratch column
        ids = ctx.tokens.gather(1, torch.where(valid, pos, 0))
        cols = torch.arange(t_len, device=self.device)
        mask = (cols[None, None, :] <= pos[:, :, None]) & (valid[:, :, None] | (cols[None, None, :] == 0))
        logits = self.model.forward(ids, pos, self.cache, write_idx=pos, attn_mask=mask,
                                    logits_at=(gap - 1)[:, None])
        return logits[:, 0]

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftProposal:
        t_len = self._ensure_cache(ctx)
        logits = self._catch_up(ctx, t_len)
        if ctx.spec.method == "tree" and ctx.spec.topk > 1:
            return self._tree(ctx, logits, t_len)
        return self._chain(ctx, logits, t_len)

    def _chain(self, ctx: DraftContext, logits: torch.Tensor, t_len: int) -> DraftProposal:
        assert self.cache is not None
        k, seq = ctx.spec.depth, ctx.seq_lens
        greedy = bool((ctx.temperature <= 0).all())
        cols = torch.arange(t_len, device=self.device)
        drafts, qs = [], []
        for j in range(k):
            if greedy:
                tok = logits.argmax(dim=-1)
            else:
                q = processed_probs(logits, ctx.temperature, ctx.top_p, ctx.top_k)
                tok = sample(q, ctx.generator)
                qs.append(q)
            drafts.append(tok)
            if j < k - 1:
                p = (seq + j)[:, None]  # d_j sits right after the root (at seq - 1)
                mask = cols[None, None, :] <= p[:, :, None]
                logits = self.model.forward(tok[:, None], p, self.cache, write_idx=p, attn_mask=mask)[:, 0]
        self._valid_end = seq + k - 1
        return chain_proposal(ctx.roots, torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None)

    def _tree(self, ctx: DraftContext, logits: torch.Tensor, t_len: int) -> DraftProposal:
        """EAGLE-2-style: expand the top-k frontier per depth, rerank by cumulative log-prob (spec/tree.topk_tree)."""
        assert self.cache is not None
        kk, depth, seq = ctx.spec.topk, ctx.spec.depth, ctx.seq_lens
        b = seq.shape[0]
        cols = torch.arange(t_len, device=self.device)
        logq = torch.log_softmax(logits.float(), dim=-1)
        lp, tok = logq.topk(kk, dim=-1)  # [B, K]
        lv_tok, lv_par, lv_lp = [tok], [torch.zeros_like(tok)], [lp]
        front_tok, front_idx, front_score = tok, torch.arange(kk, device=self.device).expand(b, kk), lp
        anc_cols = torch.zeros(b, kk, 0, dtype=torch.int64, device=self.device)  # ancestors' cache columns
        for d in range(1, depth):
            own = (seq[:, None] + (d - 1) * kk + torch.arange(kk, device=self.device)[None, :])  # [B, K]
            my_cols = torch.cat([anc_cols, own[..., None]], dim=2)  # [B, K, d]
            pos = (seq + d - 1)[:, None].expand(b, kk)
            mask = (cols[None, None, :] < seq[:, None, None]).expand(b, kk, t_len).clone()
            mask.scatter_(2, my_cols, True)
            out = self.model.forward(front_tok, pos, self.cache, write_idx=own, attn_mask=mask)  # [B, K, V]
            clp, ctok = torch.log_softmax(out.float(), dim=-1).topk(kk, dim=-1)  # [B, K, K]
            lv_tok.append(ctok.reshape(b, kk * kk))
            lv_par.append(front_idx[:, :, None].expand(b, kk, kk).reshape(b, kk * kk))
            lv_lp.append(clp.reshape(b, kk * kk))
            cum = (front_score[:, :, None] + clp).reshape(b, kk * kk)
            front_score, sel = cum.topk(kk, dim=-1)  # [B, K] best expansions become the next frontier
            front_tok = ctok.reshape(b, kk * kk).gather(1, sel)
            front_idx = sel
            anc_cols = my_cols.gather(1, (sel // kk)[..., None].expand(b, kk, d))
        self._valid_end = seq.clone()
        return topk_tree(ctx.roots, lv_tok, lv_par, lv_lp, budget=ctx.spec.verify_tokens)
