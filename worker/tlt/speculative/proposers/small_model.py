"""Small-model drafter: any causal LM sharing the target's tokenizer (e.g. a smaller model of the same family)
drafts a chain of `ctx.max_depth` tokens or an EAGLE-2-style top-k tree, from its own KV cache.

Implements speculative/proposers/protocol.Proposer. The drafter keeps one cache row per batch row and remembers, per row, which
sequence (group, sample) it holds and which tokens it has fed. Each `propose` compares that with the row's history:
the longest common prefix stays cached, the rest ("catch-up": the prompt on a sequence's first step, the newly
accepted tokens and the new root afterwards, the whole history when the engine moved a sequence to another row) is
fed in one forward. Chains sample drafts from the drafter's processed distribution with the target's sampling
settings (with each row's own random stream, DraftContext.streams) and hand those distributions to the verifier (exact speculative sampling); greedy rows and top-k trees are
deterministic (draft_probs None, for which the verifier's rule is exact too).

    proposer = SmallModelProposer(draft_model)
    engine = Engine(target, eos_ids=..., controller=AdaptiveSd.fixed(chain_arm("small", 4)),
                    proposers={"small": proposer})
Run the tests: `python -m pytest tests/engine/test_engine_spec_greedy.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.decoding.kv_cache import KVCache
from worker.tlt.decoding.sampling import pick_with_noise, processed_probs, sample
from worker.tlt.kernels import draft_noise
from worker.tlt.model.transformer import Transformer
from worker.tlt.speculative.proposers.draft_tree import chain_proposal, topk_tree
from worker.tlt.speculative.proposers.protocol import DraftContext, DrafterBase


@dataclass(frozen=True)
class SmallModelConfig:
    max_len: int = 16384  # upper bound of drafter KV columns per row (grown on demand up to this)
    seed: int = 0  # the drafter's own torch.Generator (sampled chain drafts of a context without streams)


class SmallModelProposer(DrafterBase):
    def __init__(self, model: Transformer, config: SmallModelConfig | None = None) -> None:
        self.model = model.eval()
        self.config = config or SmallModelConfig()
        self.device = model.head_weight.device
        self.cache: KVCache | None = None
        self._rows: list[tuple[int, int]] = []  # sequence held by each cache row
        self._fed: list[list[int]] = []  # tokens whose K/V are in each cache row, in column order
        self.gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self._tk = self.config.max_len  # columns attended this step (bounded by the longest history + draft)

    def reset(self) -> None:
        self._rows, self._fed = [], []

    def release(self) -> int:
        """Free the drafter's KV cache (the engine's release_memory); the next proposal re-feeds whole histories."""
        freed = self.cache.nbytes if self.cache is not None else 0
        self.cache = None
        self.reset()
        return freed

    def _ensure_cache(self, batch: int, need_len: int) -> None:
        """Grow the cache (rows and columns, keeping its contents) to at least batch rows of need_len columns."""
        if need_len > self.config.max_len:
            raise ValueError(f"history + draft of {need_len} tokens exceeds SmallModelConfig.max_len")
        old = self.cache
        if old is not None and old.slots >= batch and old.max_len >= need_len:
            return
        w = self.model.head_weight
        slots = max(batch, old.slots if old is not None else 0)
        cols = min(self.config.max_len, max(need_len, 2 * (old.max_len if old is not None else 0)))
        cols = (cols + 63) // 64 * 64
        self.cache = KVCache.allocate(self.model.args, slots, cols, w.device, w.dtype)
        if old is not None:
            for new_t, old_t in zip((*self.cache.k, *self.cache.v), (*old.k, *old.v), strict=True):
                new_t[: old.slots, :, : old.max_len] = old_t
        if self.model.rope_cos.shape[0] < cols:
            self.model.init_rope(w.device, cols)

    def _catch_up(self, ctx: DraftContext) -> torch.Tensor:  # -> drafter logits after each root [B, V]
        b = ctx.batch_size
        while len(self._rows) < b:
            self._rows.append((-1, -1))
            self._fed.append([])
        starts, gaps = [], []
        for i in range(b):
            hist, ident = ctx.histories[i], (ctx.group_ids[i], ctx.sample_ids[i])
            if self._rows[i] != ident:
                self._rows[i], self._fed[i] = ident, []
            fed, n = self._fed[i], 0
            limit = min(len(fed), len(hist) - 1)  # the root is always fed again (its logits start the draft)
            while n < limit and fed[n] == hist[n]:
                n += 1
            starts.append(n)
            gaps.append(list(hist[n:]))
            self._fed[i] = list(hist)
        s = max(len(g) for g in gaps)
        ids = torch.zeros(b, s, dtype=torch.int64)
        for i, g in enumerate(gaps):
            ids[i, : len(g)] = torch.tensor(g)
        dev = self.device
        assert self.cache is not None
        t_len = self.cache.max_len
        start = torch.tensor(starts, device=dev)
        gap = torch.tensor([len(g) for g in gaps], device=dev)
        i_s = torch.arange(s, device=dev)
        valid = i_s[None, :] < gap[:, None]
        pos = torch.where(valid, start[:, None] + i_s[None, :], t_len - 1)  # padding writes a scratch column
        cols = torch.arange(self._tk, device=dev)
        mask = (cols[None, None, :] <= pos[:, :, None]) & (valid[:, :, None] | (cols[None, None, :] == 0))
        assert self.cache is not None
        logits = self.model.forward(ids.to(dev), pos, self.cache, write_idx=pos, attn_mask=mask,
                                    logits_at=(gap - 1)[:, None])
        return logits[:, 0]

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftProposal:
        longest = max(len(h) for h in ctx.histories) + ctx.max_nodes * max(ctx.topk, 1) + 2
        self._ensure_cache(ctx.batch_size, longest)
        assert self.cache is not None
        self._tk = min(self.cache.max_len, (longest + 63) // 64 * 64)
        logits = self._catch_up(ctx)
        seq = torch.tensor([len(h) for h in ctx.histories], device=self.device)  # root at seq - 1
        depth = max(0, min(ctx.max_depth, ctx.max_nodes - 1))
        if depth == 0:
            return chain_proposal(ctx.roots(), torch.zeros(ctx.batch_size, 0, dtype=torch.int64, device=self.device))
        if ctx.topk > 1:
            return self._tree(ctx, logits, seq, depth)
        return self._chain(ctx, logits, seq, depth)

    def _chain(self, ctx: DraftContext, logits: torch.Tensor, seq: torch.Tensor, k: int) -> DraftProposal:
        assert self.cache is not None
        sp = ctx.sampling
        greedy = sp is None or bool((sp.temperature <= 0).all())
        cols = torch.arange(self._tk, device=self.device)
        drafts, qs = [], []
        for j in range(k):
            if greedy or sp is None:
                tok = logits.argmax(dim=-1)
            else:
                q = processed_probs(logits, sp.temperature, sp.top_p, sp.top_k)
                # the row's own stream where the engine passes it (batch-independent drafts), else the generator
                tok = (sample(q, self.gen) if ctx.streams is None
                       else pick_with_noise(q, draft_noise(ctx.streams, j, q.shape[-1])))
                qs.append(q)
            drafts.append(tok)
            if j < k - 1:
                p = (seq + j)[:, None]  # d_j sits right after the root
                mask = cols[None, None, :] <= p[:, :, None]
                logits = self.model.forward(tok[:, None], p, self.cache, write_idx=p, attn_mask=mask)[:, 0]
        stacked = torch.stack(drafts, 1)  # [B, k]
        for i, row in enumerate(stacked[:, : k - 1].tolist()):
            self._fed[i].extend(row)
        return chain_proposal(ctx.roots(), stacked, torch.stack(qs, 1) if qs else None)

    def _tree(self, ctx: DraftContext, logits: torch.Tensor, seq: torch.Tensor, depth: int) -> DraftProposal:
        """EAGLE-2-style: expand the top-k frontier per depth, rerank by cumulative log-prob (speculative/proposers/draft_tree.topk_tree).
        Tree nodes go to scratch columns after the history; they are not a prefix, so `_fed` stays the history."""
        assert self.cache is not None
        kk, b, dev = ctx.topk, ctx.batch_size, self.device
        cols = torch.arange(self._tk, device=dev)
        lp, tok = torch.log_softmax(logits.float(), dim=-1).topk(kk, dim=-1)  # [B, K]
        lv_tok, lv_par, lv_lp = [tok], [torch.zeros_like(tok)], [lp]
        front_tok, front_idx, front_score = tok, torch.arange(kk, device=dev).expand(b, kk), lp
        anc_cols = torch.zeros(b, kk, 0, dtype=torch.int64, device=dev)  # ancestors' cache columns
        for d in range(1, depth):
            own = seq[:, None] + (d - 1) * kk + torch.arange(kk, device=dev)[None, :]  # [B, K]
            my_cols = torch.cat([anc_cols, own[..., None]], dim=2)  # [B, K, d]
            pos = (seq + d - 1)[:, None].expand(b, kk)
            mask = (cols[None, None, :] < seq[:, None, None]).expand(b, kk, cols.shape[0]).clone()
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
        return topk_tree(ctx.roots(), lv_tok, lv_par, lv_lp, budget=ctx.max_nodes)

