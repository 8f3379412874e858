"""`EagleProposer`: the EAGLE drafter as a spec `Proposer` (chain of k tokens or an EAGLE-2 top-k tree).

Target features come from the engine's hidden hook: `observe(seq_ids, token_ids, hidden)` keeps the last `context`
feature rows of each sequence in a device ring (feature_ring.py). When a `DraftContext` carries
`hidden`/`hidden_lens` itself, those are used instead.

Each `propose(ctx)` recomputes the drafter over the last `context` positions of every row (drafter entries
(x_{j+1}, h_j) at RoPE position j, the last one being (root, h_{L-1})), so nothing drafter-side has to be rolled back
after verification; then it drafts with a drafter-side K/V of the draft entries:
- chain (`topk == 1`): k = min(max_depth, max_nodes - 1) tokens. Every row samples each token from the drafter's
  processed distribution q (same temperature / top-p / top-k as the target row; a greedy row's q is the one-hot at
  the argmax, so its drafts are the argmax chain) and hands the q rows to the verifier (rows of one temperature
  without top-k / top-p, with the drafter's fused step on: kernels/draft_sample.py draws the token and writes q in
  three kernels instead of ~7 torch ones). The draft is k + 1 drafter
  forwards with fixed shapes and no host sync (`chain_draft_no_sync`): the host packs the last `context` history
  tokens, ring indices and lengths of every row into one int64 array, copied to the device without waiting
  (pinned, non_blocking); the drafter K/V is one buffer [B, Hkv, context + k - 1, D] written by column. On CUDA the
  whole draft is captured once per (batch bucket, depth) as a CUDA graph and replayed (chain_graph.py).
- tree (`topk > 1`): EAGLE-2 expansion pruned to ctx.max_nodes (tree_draft.py). Eager.
Weights come from the spot trainer as versioned snapshots, loaded at rollout start (`load_snapshot`, an in-place copy
that captured graphs see), never mid-rollout. A graphed chain proposal is the graph's output buffers themselves
(tokens, parents, counts, draft_probs): valid until the next `propose` (the engine verifies and feeds the hook
before drafting again). Host work per graphed draft (the GPU idles through it): the pack (incremental: only new
history tokens), one upload through a reused pinned buffer (buffer.HostStage), one feature gather, the replay.

Run the tests: `python -m pytest tests/drafter/test_drafter_proposer.py tests/drafter/test_drafter_chain_graph.py -q`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker.tlt.drafter.buffer import HostStage, to_device_no_sync
from worker.tlt.drafter.chain_graph import ChainGraph, batch_bucket, record_graph
from worker.tlt.drafter.feature_ring import FeatureRing, SeqId
from worker.tlt.drafter.model import DraftKV, EagleDrafter
from worker.tlt.drafter.train import DrafterSnapshot
from worker.tlt.drafter.tree_draft import tree_draft
from worker.tlt.spec.proposer import DraftContext
from worker.tlt.spec.sampling import exponential_noise, processed_probs, sample
from worker.tlt.spec.types import DraftProposal


@dataclass(frozen=True)
class EagleProposerConfig:
    topk: int = 1  # 1 = chain; > 1 = top-k tree (EAGLE-2), pruned to ctx.max_nodes
    context: int = 64  # drafter positions recomputed per propose (the drafter's attention window)
    max_seqs: int = 1024  # sequences whose feature rings fit (grows on demand)
    seed: int = 0  # generator for sampled chain drafts
    cuda_graphs: bool = True  # chain drafts replay a CUDA graph per (batch bucket, depth) on CUDA
    graph_max_batch: int = 64  # larger batches draft eagerly


class EagleProposer:
    def __init__(self, drafter: EagleDrafter, config: EagleProposerConfig | None = None) -> None:
        self.drafter = drafter.eval()
        self.config = config or EagleProposerConfig()
        self.device = next(drafter.parameters()).device
        self.version = 0  # snapshot version loaded
        self.gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self.features = FeatureRing(self.config.context, drafter.feature_dim, self.device)
        # (batch bucket, depth, DraftContext.filters) -> captured chain draft
        self._graphs: dict[tuple[int, int, tuple[int, bool, float]], ChainGraph] = {}
        # graph key -> [Bb*W + Bb*(2W+2)] int64: the ring index of every entry, then the graph's `packed` (a view)
        self._staged: dict[tuple[int, int, tuple[int, bool, float]], torch.Tensor] = {}
        # (graph key, batch) -> the graph's buffers sliced to the batch: (ring index, feats, temp, top_p, top_k, out)
        self._views: dict[tuple[tuple[int, int, tuple[int, bool, float]], int], tuple[Any, ...]] = {}
        self._sampled: dict[tuple[int, int, tuple[int, bool, float]], object] = {}  # graph key -> ctx.sampling copied in
        self._stage = HostStage(self.device)  # the packed inputs -> a graph's buffer, every draft
        self._pool: object | None = None  # one memory pool shared by this proposer's graphs

    # ------------------------------------------------------------------------------------------------ weights
    def load_snapshot(self, snap: DrafterSnapshot) -> bool:
        """Load newer weights (call at rollout start); False when `snap` is not newer than what is loaded."""
        if snap.version <= self.version:
            return False
        self.drafter.load_state_dict(snap.state, strict=True)  # in place: captured graphs read the new weights
        self.version = snap.version
        return True

    def reset(self) -> None:
        self.features.reset()

    # ------------------------------------------------------------------------------------------------ features
    def _to_device_no_sync(self, arr: np.ndarray) -> torch.Tensor:
        return to_device_no_sync(arr, self.device)

    def observe(
        self,
        seq_ids: Sequence[SeqId],  # [N] sequence of each row
        token_ids: torch.Tensor,  # [N] (unused: the context tokens come from the histories)
        hidden: torch.Tensor,  # [N, >= F] target feature of each row (the first F columns), in position order
    ) -> None:
        """The engine hook: remember the last `context` features of each sequence (no host sync)."""
        self.features.observe(seq_ids, hidden)

    def _pack(self, ctx: DraftContext, rows: int) -> np.ndarray:  # [rows, 2W + 2] int64, layout: FeatureRing.pack
        return self.features.pack(ctx, rows)

    def _inputs(self, ctx: DraftContext, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> tokens [B, W] (x_{j+1}), features [B, W, F] (h_j), valid entries per row m [B]; right-aligned."""
        w = self.config.context
        toks = packed[:, :w]
        if ctx.hidden is not None and ctx.hidden_lens is not None:
            t = ctx.hidden.shape[1]
            feats = ctx.hidden[:, -w:, : self.drafter.feature_dim].to(self.device, torch.float32)  # hook rows
            if t < w:
                feats = torch.nn.functional.pad(feats, (0, 0, w - t, 0))
            m = torch.minimum(ctx.hidden_lens.to(self.device), packed[:, 2 * w + 1] - 1).clamp(0, w)
        else:
            feats = self.features.gather(packed[:, w: 2 * w])
            m = packed[:, 2 * w]
        return toks, feats, m

    # ------------------------------------------------------------------------------------------------ drafting
    def _context_forward(self, toks: torch.Tensor, feats: torch.Tensor, m: torch.Tensor, hist_len: torch.Tensor,
                         kv: DraftKV | None) -> tuple[torch.Tensor, DraftKV, torch.Tensor, torch.Tensor]:
        """The drafter over the W context entries -> (root output [B, 1, H], K/V, valid [B, W], last position [B])."""
        w = toks.shape[1]
        dev = toks.device
        col = torch.arange(w, device=dev)
        valid = col[None, :] >= (w - m)[:, None]  # [B, W]
        last_pos = hist_len - 2  # position j of the last entry (root, h_{L-1}), L = len(history) - 1
        pos = (last_pos[:, None] - (w - 1) + col[None, :]).clamp_min(0)  # [B, W]
        mask = torch.tril(torch.ones(w, w, dtype=torch.bool, device=dev))[None] & valid[:, None, :]
        mask = mask | torch.eye(w, dtype=torch.bool, device=dev)[None]  # padded entries attend to themselves
        out, kv = self.drafter.step(toks, feats, pos, kv, mask, write_at=0 if kv is not None else None)
        return out[:, -1:], kv, valid, last_pos

    @torch.no_grad()
    def chain_draft_no_sync(
        self,
        toks: torch.Tensor,  # [B, W] int64 context tokens x_{j+1}; toks[:, -1] is the root
        feats: torch.Tensor,  # [B, W, F] context features h_j
        m: torch.Tensor,  # [B] int64 valid (right-aligned) entries; 0 = no features yet: root only
        hist_len: torch.Tensor,  # [B] int64 history length
        temp: torch.Tensor,  # [B] float32 (0 = greedy)
        top_p: torch.Tensor,  # [B] float32
        top_k: torch.Tensor,  # [B] int64
        k: int,  # tokens to draft (>= 1)
        filters: tuple[int, bool, float] = (-1, True, -1.0),  # DraftContext.filters: (common top-k, 0 none, -1 per
        #   row; any top-p; common temperature > 0 or -1)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """k + 1 drafter forwards with fixed shapes, no host sync (graph-capturable).
        -> tokens [B, k+1], parents [B, k+1], counts [B], draft_probs [B, k+1, V] (DraftProposal fields)."""
        d = self.drafter
        bsz, w = toks.shape
        dev = toks.device
        kv = DraftKV.allocate(bsz, d.args, w + k - 1, like=d.fc.weight)
        o, kv, valid, last_pos = self._context_forward(toks, feats, m, hist_len, kv)
        attend = torch.cat([valid, torch.ones(bsz, k - 1, dtype=torch.bool, device=dev)], dim=1)  # [B, W + k - 1]
        drafts, qs = [], []
        common_k, use_p, common_t = filters
        row_k = top_k if common_k < 0 else common_k  # a number: skipped (0) or torch.topk, no sort
        row_t = temp if common_t <= 0.0 else common_t  # a number: softmax(logits / T), no per-row greedy one-hot
        # one temperature, no filters, the drafter on the fused kernels: its sampling too (kernels/draft_sample.py,
        # 3 kernels for ~7; the same noise draw from the generator, the same law)
        fused = common_t > 0.0 and common_k == 0 and not use_p and d.fused_step_on(dev)
        for step in range(k):
            logits = d.logits(o[:, 0])
            if fused:
                from worker.tlt.kernels.draft_sample import draft_sample  # imports triton: only on this path

                tok, q = draft_sample(logits, exponential_noise(logits, self.gen), common_t)
            else:
                q = processed_probs(logits.float(), row_t, top_p if use_p else 1.0, row_k)
                tok = sample(q, self.gen)
            drafts.append(tok)
            qs.append(q)
            if step + 1 == k:
                break
            pos = (last_pos + 1 + step)[:, None]
            o, kv = d.step(tok[:, None], o, pos, kv, attend[:, None, : w + step + 1], write_at=w + step)
        tokens = torch.cat([toks[:, -1:], torch.stack(drafts, 1)], dim=1)
        counts = torch.where(m > 0, k + 1, 1)
        idx = torch.arange(k + 1, device=dev).expand(bsz, k + 1)
        parents = torch.where(idx < counts[:, None], idx - 1, -1)
        # row i of draft_probs is the q that sampled node i's child; the last node has none
        probs = torch.cat([torch.stack(qs, 1), qs[0].new_zeros(bsz, 1, qs[0].shape[-1])], dim=1)
        return tokens, parents, counts, probs

    def propose(self, ctx: DraftContext) -> DraftProposal:
        if torch.is_grad_enabled():  # a direct call; the engine's step already runs without (a decorator: ~10 us)
            with torch.no_grad():
                return self.propose(ctx)
        bsz = ctx.batch_size
        if self.config.topk <= 1:
            k = max(0, min(ctx.max_depth, ctx.max_nodes - 1))
            if k == 0:
                root = self._to_device_no_sync(self._pack(ctx, bsz))[:, self.config.context - 1]
                return DraftProposal(root[:, None], torch.full_like(root[:, None], -1), torch.ones_like(root))
            if self._graphable(bsz, ctx):
                return self._chain_graphed(ctx, k)
            packed = self._to_device_no_sync(self._pack(ctx, bsz))
            toks, feats, m = self._inputs(ctx, packed)
            temp, top_p, top_k = self._sampling(ctx)
            t, p, c, q = self.chain_draft_no_sync(toks, feats, m, packed[:, -1], temp, top_p, top_k, k, ctx.filters)
            return DraftProposal(t, p, c, q)
        packed = self._to_device_no_sync(self._pack(ctx, bsz))
        toks, feats, m = self._inputs(ctx, packed)
        o, kv, valid, last_pos = self._context_forward(toks, feats, m, packed[:, -1], None)
        prop = tree_draft(self.drafter, toks[:, -1], o, kv, valid, last_pos, self.config.topk, ctx.max_depth,
                          ctx.max_nodes)
        has_ctx = m > 0  # rows without features yet: root only (plain decoding for that row)
        keep = has_ctx[:, None] | (torch.arange(prop.num_nodes, device=self.device)[None, :] == 0)
        return DraftProposal(tokens=prop.tokens, parents=torch.where(keep, prop.parents, -1),
                             counts=torch.where(has_ctx, prop.counts, 1), draft_probs=prop.draft_probs)

    def _sampling(self, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sp = ctx.sampling
        if sp is None:  # no settings: greedy drafts
            z = torch.zeros(ctx.batch_size, device=self.device)
            return z, torch.ones_like(z), torch.zeros(ctx.batch_size, dtype=torch.int64, device=self.device)
        return sp.temperature.to(self.device), sp.top_p.to(self.device), sp.top_k.to(self.device)

    # ------------------------------------------------------------------------------------------------ graphs
    def _graphable(self, bsz: int, ctx: DraftContext) -> bool:
        return (self.device.type == "cuda" and self.config.cuda_graphs and ctx.hidden is None
                and batch_bucket(bsz) <= self.config.graph_max_batch)

    def _chain_graphed(self, ctx: DraftContext, k: int) -> DraftProposal:
        """Fill the graph's static inputs and replay it. Host work per draft: the pack, one upload, one feature
        gather; the rows' sampling settings only when ctx.sampling is another object than last time (treated as
        immutable: the engine builds a new context when its rows change). The proposal is the graph's output
        buffers (no copies): valid until the next propose."""
        bsz, w = ctx.batch_size, self.config.context
        bb = batch_bucket(bsz)
        key = (bb, k, ctx.filters)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(bb, k, ctx.filters)
        staged = self._staged[key]
        v = self._views.get((key, bsz))
        if v is None:
            v = self._views[(key, bsz)] = (staged[: bsz * w], g.feats[:bsz].view(bsz * w, -1), g.temp[:bsz],
                                           g.top_p[:bsz], g.top_k[:bsz], tuple(o[:bsz] for o in g.out))
        ring_idx, feats, temp, top_p, top_k, out = v
        self.features.pack(ctx, bb, lead=True, out=self._stage.host_for(staged))  # one upload, one gather
        self._stage.send(staged)
        torch.index_select(self.features.rows2d, 0, ring_idx, out=feats)
        if ctx.sampling is None or self._sampled.get(key) is not ctx.sampling:
            for dst, src in zip((temp, top_p, top_k), self._sampling(ctx), strict=True):
                dst.copy_(src)
            self._sampled[key] = ctx.sampling
        g.graph.replay()
        return DraftProposal(*out)

    @torch.no_grad()
    def capture_chain(self, batches: Sequence[int], depth: int,
                      filters: tuple[int, bool, float] = (0, False, -1.0)) -> int:
        """Capture the chain graphs of these batch sizes' buckets at `depth` ahead of time (so that no capture lands
        inside a timed rollout) for rows sampling with these filters (DraftContext.filters; default: no top-k, no
        top-p); returns how many were captured. No-op off CUDA."""
        if self.device.type != "cuda" or not self.config.cuda_graphs:
            return 0
        todo = {batch_bucket(b) for b in batches if batch_bucket(b) <= self.config.graph_max_batch} - {
            bb for bb, k, f in self._graphs if k == depth and f == filters}
        for bb in sorted(todo):
            self._graphs[(bb, depth, filters)] = self._capture(bb, depth, filters)
        return len(todo)

    def _capture(self, bb: int, k: int, filters: tuple[int, bool, float]) -> ChainGraph:
        """Capture the chain draft of `k` tokens for a batch bucket `bb` (static buffers allocated here)."""
        w, dev = self.config.context, self.device
        staged = self._staged[(bb, k, filters)] = torch.zeros(bb * w + bb * (2 * w + 2), dtype=torch.int64,
                                                               device=dev)
        packed = staged[bb * w:].view(bb, 2 * w + 2)  # the ring index leads (contiguous, for the gather)
        packed[:, -1] = 2
        feats = torch.zeros(bb, w, self.features.feature_dim, device=dev)
        temp, top_p = torch.zeros(bb, device=dev), torch.ones(bb, device=dev)
        top_k = torch.zeros(bb, dtype=torch.int64, device=dev)

        def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.chain_draft_no_sync(packed[:, :w], feats, packed[:, 2 * w], packed[:, -1], temp, top_p,
                                            top_k, k, filters)

        graph, out = self._record(run)
        self._sampled.pop((bb, k, filters), None)  # fresh buffers: the next draft copies the settings in
        self._views = {vk: v for vk, v in self._views.items() if vk[0] != (bb, k, filters)}
        return ChainGraph(graph, packed, feats, temp, top_p, top_k, out)

    def _record(self, run: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """Capture `run` into a CUDA graph in this proposer's memory pool -> (graph, its static outputs)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return record_graph(run, self.gen, self._pool, self.device)
