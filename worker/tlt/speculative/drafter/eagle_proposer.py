"""`EagleProposer`: the EAGLE drafter as a spec `Proposer` (chain of k tokens or an EAGLE-2 top-k tree).

Target features come from the engine's hidden hook: `observe(seq_ids, token_ids, hidden)` keeps the last `context`
feature rows of each sequence in a device ring (feature_ring.py). When a `DraftContext` carries
`hidden`/`hidden_lens` itself, those are used instead.

Each `propose(ctx)` recomputes the drafter over the last `context` positions of every row (drafter entries
(x_{j+1}, h_j) at RoPE position j, the last one being (root, h_{L-1})), so nothing drafter-side has to be rolled back
after verification; then it drafts with a drafter-side K/V of the draft entries:
- chain (`ctx.topk == 1`): k = min(max_depth, max_nodes - 1) tokens. Every row samples each token from the drafter's
  processed distribution q (same temperature / top-p / top-k as the target row; a greedy row's q is the one-hot at
  the argmax, so its drafts are the argmax chain) and hands the q rows to the verifier (rows of one temperature
  without top-k / top-p, with the drafter's fused step on: kernels/draft_sample.py draws the token and writes q in
  three kernels instead of ~7 torch ones). The draft is k + 1 drafter
  forwards with fixed shapes and no host sync (`chain_draft_no_sync`): the host packs the last `context` history
  tokens, ring indices and lengths of every row into one int64 array, copied to the device without waiting
  (pinned, non_blocking); the drafter K/V is one buffer [B, Hkv, context + k - 1, D] written by column. On CUDA the
  whole draft is captured once per (batch bucket, depth) as a CUDA graph and replayed (chain_graph.py), reading its
  inputs from a device-side DraftWindow (draft_window.py) that the engine advances after each verification, so
  consecutive speculative steps on the same rows skip the pack, the upload and the hook's ring writes.
- tree (`ctx.topk > 1`): EAGLE-2 expansion pruned to ctx.max_nodes (eagle_tree.py). Eager.
Weights come from the spot trainer as versioned snapshots, loaded at rollout start (`load_snapshot`, an in-place copy
that captured graphs see), never mid-rollout. A graphed chain proposal is the graph's output buffers themselves
(tokens, parents, counts, draft_probs): valid until the next `propose` (the engine verifies and feeds the hook
before drafting again). Host work per graphed draft (the GPU idles through it): the window check and the replay;
when the rows changed, a window load (the pack, one upload through a reused pinned buffer, one feature gather).

Run the tests: `python -m pytest tests/drafter/test_drafter_proposer.py tests/drafter/test_drafter_chain_graph.py -q`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.decoding.sampling import DraftFilters, pick_with_noise, processed_probs, sample
from worker.tlt.decoding.uploads import HostStage, to_device_no_sync
from worker.tlt.kernels import draft_noise
from worker.tlt.speculative.drafter.chain_graph import ChainGraph, batch_bucket, record_graph
from worker.tlt.speculative.drafter.draft_window import DraftWindow
from worker.tlt.speculative.drafter.eagle_tree import tree_draft
from worker.tlt.speculative.drafter.feature_ring import FeatureRing, SeqId
from worker.tlt.speculative.drafter.model import DraftKV, EagleDrafter
from worker.tlt.speculative.drafter.spot_trainer import DrafterSnapshot
from worker.tlt.speculative.proposers.protocol import DraftContext


@dataclass(frozen=True)
class EagleProposerConfig:
    context: int = 64  # drafter positions recomputed per propose (the drafter's attention window)
    max_seqs: int = 1024  # sequences whose feature rings fit (grows on demand)
    seed: int = 0  # generator for sampled chain drafts of contexts without DraftContext.streams
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
        self._graphs: dict[tuple[int, int, DraftFilters], ChainGraph] = {}
        self._sampled: dict[tuple[int, int, DraftFilters], object] = {}  # graph key -> ctx.sampling copied in
        self._stage = HostStage(self.device)  # a window load's packed inputs -> the device, one upload
        self._load_staged: torch.Tensor | None = None
        self._window: DraftWindow | None = None  # the graphs' inputs, kept on the device (made at the first capture)
        self._drafted = False  # the last propose replayed a graph on the window (the engine verifies it next)
        self._window_fed = False  # inside `advanced`: the hook's rows of that step are already in the window
        self._pool: object | None = None  # one memory pool shared by this proposer's graphs
        self._vocab: torch.Tensor | None = None  # EAGLE-1 draft vocabulary (sorted target ids; None: all)
        self._head_rows: torch.Tensor | None = None  # the target head's rows of it
        self._head_key: tuple[int, int] | None = None  # (data_ptr, version) of the head they were copied from

    # ------------------------------------------------------------------------------------------------ weights
    def load_snapshot(self, snap: DrafterSnapshot) -> bool:
        """Load newer weights (call at rollout start); False when `snap` is not newer than what is loaded."""
        if snap.version <= self.version:
            return False
        self.drafter.load_state_dict(snap.state, strict=True)  # in place: captured graphs read the new weights
        self.version = snap.version
        return True

    def release(self) -> int:
        """Nothing to free for the engine's memory release: the chain graphs read the feature ring and the
        proposer's own buffers, not the engine's cache (a few MB, kept so that no re-capture is needed)."""
        return 0

    def reset(self) -> None:
        self.features.reset()
        if self._window is not None:
            self._window.ctx = None  # forgotten with the ring: nothing to write back
        self._drafted = False

    # ------------------------------------------------------------------------------------------------ features
    def _to_device_no_sync(self, arr: np.ndarray) -> torch.Tensor:
        return to_device_no_sync(arr, self.device)

    def observe(
        self,
        seq_ids: Sequence[SeqId],  # [N] sequence of each row
        token_ids: torch.Tensor,  # [N] (unused: the context tokens come from the histories)
        hidden: torch.Tensor,  # [N, >= F] target feature of each row (the first F columns), in position order
    ) -> None:
        """The engine hook: remember the last `context` features of each sequence (no host sync). Rows of a step
        whose features the draft window took itself (`advanced`) are skipped; any other rows first make the
        window write its features back (the ring takes rows in order)."""
        if self._window_fed:
            return
        self._flush_window()
        self.features.observe(seq_ids, hidden)

    def _flush_window(self) -> None:
        if self._window is not None and self._window.ctx is not None:
            self._window.flush_into(self.features)

    # ------------------------------------------------------------------------------------------------ window
    def advance(self, tokens: torch.Tensor, hidden: torch.Tensor, emitted: torch.Tensor) -> bool:
        """The engine, after verifying this proposer's last draft, before reading the result (device work only):
        tokens [>=B, K] emitted in order, hidden [>=B, >=K, >=F] hook rows of the verified nodes, emitted [>=B].
        True when the draft window took them: the engine then wraps the step's hook call in `advanced`."""
        drafted, self._drafted = self._drafted, False
        if not drafted or self._window is None or self._window.ctx is None:
            return False
        self._window.advance(tokens, hidden, emitted)
        return True

    @contextmanager
    def advanced(self, emitted: list[int]) -> Iterator[None]:
        """Once the step's emitted counts are read: the window's host mirror follows, and observe skips the step's
        hook rows inside this block (they are in the window already)."""
        assert self._window is not None
        self._window.mirror(emitted)
        self._window_fed = True
        try:
            yield
        finally:
            self._window_fed = False

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
        filters: DraftFilters = DraftFilters(),  # DraftContext.filters (default: nothing known, per-row work)
        streams: tuple[torch.Tensor, torch.Tensor] | None = None,  # DraftContext.streams ([B] each); None: self.gen
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """k + 1 drafter forwards with fixed shapes, no host sync (graph-capturable).
        -> tokens [B, k+1], parents [B, k+1], counts [B], draft_probs [B, k+1, V] (DraftProposal fields).
        Sampled drafts race against each row's own stream (`streams`: kernels.draft_noise, keyed on the
        emitted-token index each draft proposes, so a row drafts the same whatever the batch) or the generator."""
        d = self.drafter
        bsz, w = toks.shape
        dev = toks.device
        kv = DraftKV.allocate(bsz, d.args, w + k - 1, like=d.fc.weight)
        o, kv, valid, last_pos = self._context_forward(toks, feats, m, hist_len, kv)
        attend = torch.cat([valid, torch.ones(bsz, k - 1, dtype=torch.bool, device=dev)], dim=1)  # [B, W + k - 1]
        drafts: list[torch.Tensor] = []
        common_k, use_p, common_t = filters
        row_k = top_k if common_k < 0 else common_k  # a number: skipped (0) or torch.topk, no sort
        row_t = temp if common_t <= 0.0 else common_t  # a number: softmax(logits / T), no per-row greedy one-hot
        # one temperature, no filters, the drafter on the fused kernels: its sampling too (kernels/draft_sample.py,
        # 3 kernels for ~7; the same noise draw from the generator, the same law)
        fused = common_t > 0.0 and common_k == 0 and not use_p and d.fused_step_on(dev)
        head, vocab = self._draft_head()
        # row i of draft_probs is the q that sampled node i's child (the last node has none: zeros); each step writes
        # its row in place (zeros outside a draft vocabulary)
        probs = torch.zeros(bsz, k + 1, d.args.vocab_size, dtype=torch.float32, device=dev)
        noise = None  # the whole chain's race noise at once (fused) or per step
        if fused and streams is not None:
            noise = torch.stack([draft_noise(streams, step, head.shape[0]) for step in range(k)])
        elif fused:
            noise = torch.empty(k, bsz, head.shape[0], dtype=torch.float32, device=dev).exponential_(
                generator=self.gen)
        pos = last_pos[None, :] + 1 + torch.arange(k, device=dev)[:, None]  # [k, B] positions of the draft entries
        for step in range(k):
            logits = self._draft_logits(o[:, 0], head)  # [B, V'] over the draft vocabulary
            if noise is not None:
                from worker.tlt.kernels.draft_sample import draft_sample  # imports triton: only on this path

                tok, _ = draft_sample(logits, noise[step], common_t, vocab=vocab, out=probs[:, step])
            else:
                q = processed_probs(logits.float(), row_t, top_p if use_p else 1.0, row_k)
                tok = (sample(q, self.gen) if streams is None
                       else pick_with_noise(q, draft_noise(streams, step, q.shape[-1])))
                if vocab is None:
                    probs[:, step] = q
                else:
                    probs[:, step].index_copy_(-1, vocab, q)
                    tok = vocab[tok]
            drafts.append(tok)
            if step + 1 == k:
                break
            o, kv = d.step(tok[:, None], o, pos[step][:, None], kv, attend[:, None, : w + step + 1],
                           write_at=w + step)
        tokens = torch.cat([toks[:, -1:], torch.stack(drafts, 1)], dim=1)
        counts = torch.where(m > 0, k + 1, 1)
        idx = torch.arange(k + 1, device=dev).expand(bsz, k + 1)
        parents = torch.where(idx < counts[:, None], idx - 1, -1)
        return tokens, parents, counts, probs

    # ------------------------------------------------------------------------------------------------ draft vocab
    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Chain drafts of an EAGLE-1 drafter sample from its distribution restricted to these target ids
        (renormalised; EAGLE-3's d2t idea for TLT's shared head): the head GEMM and the race shrink from V to V'
        columns. Lossless whatever the set (the verifier sees q, zero outside it); acceptance drops by the target
        mass outside it. None: the whole vocabulary. A set of the current size is copied in place (the captured
        chain graphs read it and stay valid); any other change drops them (their shapes change)."""
        if ids is not None and self.drafter.cfg.kind != "eagle1":
            raise ValueError("an EAGLE-3 drafter drafts over its own draft vocabulary (EagleDrafter.set_draft_vocab)")
        new = None if ids is None else torch.unique(ids.to(self.device, torch.int64))  # sorted
        if new is not None and self._vocab is not None and new.numel() == self._vocab.numel():
            self._vocab.copy_(new)
            self._head_key = None  # the head rows follow, in place, at the next draft
            return
        self._vocab = new
        self._head_rows, self._head_key = None, None
        self._graphs.clear()
        self._sampled.clear()

    @property
    def draft_vocab(self) -> torch.Tensor | None:  # [V'] sorted target ids (a copy on the host) or None: all
        return None if self._vocab is None else self._vocab.cpu()

    @property
    def draft_vocab_size(self) -> int:
        return self.drafter.draft_vocab_size if self._vocab is None else int(self._vocab.numel())

    def _draft_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (the head drafts read: [V', H], the target id of each of its rows [V'] or None for all V in order).
        An EAGLE-1 draft vocabulary's head rows are a copy of the target head's, refreshed in place (captured graphs
        read it) whenever the target's head changed since (a weight sync, an optimizer step: its version)."""
        d = self.drafter
        if d.cfg.kind == "eagle3":
            return d.lm_head.weight, (d.draft_to_target(torch.arange(d.draft_vocab_size, device=self.device))
                                      if d.draft_vocab_size < d.args.vocab_size else None)
        w = d.target.head_weight.detach()
        if self._vocab is None:
            return w, None
        key = (w.data_ptr(), w._version)
        if self._head_rows is None or self._head_key != key:
            rows = w.index_select(0, self._vocab)
            if self._head_rows is None:
                self._head_rows = rows
            else:
                self._head_rows.copy_(rows)
            self._head_key = key
        return self._head_rows, self._vocab

    def _draft_logits(self, out: torch.Tensor, head: torch.Tensor) -> torch.Tensor:  # [B, H] -> [B, V']
        d = self.drafter
        if d.cfg.kind == "eagle3":
            return d.draft_logits(out)
        return torch.nn.functional.linear(out, head.to(out.dtype))

    def propose(self, ctx: DraftContext) -> DraftProposal:
        if torch.is_grad_enabled():  # a direct call; the engine's step already runs without (a decorator: ~10 us)
            with torch.no_grad():
                return self.propose(ctx)
        bsz = ctx.batch_size
        self._drafted = False
        if ctx.topk <= 1:
            k = max(0, min(ctx.max_depth, ctx.max_nodes - 1))
            if k > 0 and self._graphable(bsz, ctx):
                return self._chain_graphed(ctx, k)
            self._flush_window()
            if k == 0:
                root = self._to_device_no_sync(self._pack(ctx, bsz))[:, self.config.context - 1]
                return DraftProposal(root[:, None], torch.full_like(root[:, None], -1), torch.ones_like(root))
            packed = self._to_device_no_sync(self._pack(ctx, bsz))
            toks, feats, m = self._inputs(ctx, packed)
            temp, top_p, top_k = self._sampling(ctx)
            t, p, c, q = self.chain_draft_no_sync(toks, feats, m, packed[:, -1], temp, top_p, top_k, k, ctx.filters,
                                                  ctx.streams)
            return DraftProposal(t, p, c, q)
        self._flush_window()
        packed = self._to_device_no_sync(self._pack(ctx, bsz))
        toks, feats, m = self._inputs(ctx, packed)
        o, kv, valid, last_pos = self._context_forward(toks, feats, m, packed[:, -1], None)
        prop = tree_draft(self.drafter, toks[:, -1], o, kv, valid, last_pos, ctx.topk, ctx.max_depth,
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
        """Replay the graph on the draft window, loading the window first unless it holds ctx's rows as they are
        (draft_window.py). Host work per draft in a run of speculative steps on the same rows: the window check
        (the history lengths), the replay; the rows' sampling settings only when ctx.sampling is another object than
        last time (treated as immutable: the engine builds a new context when its rows change). The proposal is the
        graph's output buffers (no copies): valid until the next propose."""
        bsz = ctx.batch_size
        self._draft_head()  # refresh a draft vocabulary's head rows if the target's head changed
        key = (batch_bucket(bsz), k, ctx.filters)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(*key)
        window = self._window
        assert window is not None
        if not window.holds(ctx):
            self._flush_window()
            self._load_window(ctx)
        if ctx.sampling is None or self._sampled.get(key) is not ctx.sampling:
            for dst, src in zip((g.temp[:bsz], g.top_p[:bsz], g.top_k[:bsz]), self._sampling(ctx), strict=True):
                dst.copy_(src)
            self._sampled[key] = ctx.sampling
        if ctx.streams is not None:  # the rows' streams at this step (device copies, no sync)
            g.keys[:bsz].copy_(ctx.streams[0])
            g.n_gen[:bsz].copy_(ctx.streams[1])
        else:  # no streams: fresh keys from the proposer's generator
            g.keys.random_(generator=self.gen)
        g.graph.replay()
        self._drafted = True
        return DraftProposal(*(o[:bsz] for o in g.out))

    def _load_window(self, ctx: DraftContext) -> None:
        """The window's rows from the ring and the histories: one pack, one upload, one gather."""
        assert self._window is not None
        bsz, w = ctx.batch_size, self.config.context
        staged = self._load_buffer(bsz)
        self.features.pack(ctx, bsz, lead=True, out=self._stage.host_for(staged))
        self._stage.send(staged)
        packed = staged[bsz * w:].view(bsz, 2 * w + 2)
        feats = self.features.gather(staged[: bsz * w].view(bsz, w))
        self._window.load(ctx, packed[:, :w], feats, self.features.counts(ctx))

    def _load_buffer(self, rows: int) -> torch.Tensor:  # [rows*W + rows*(2W+2)] int64 on the device (pack's lead)
        w = self.config.context
        size = rows * w + rows * (2 * w + 2)
        if self._load_staged is None or self._load_staged.numel() < size:
            self._load_staged = torch.zeros(size, dtype=torch.int64, device=self.device)
        return self._load_staged[:size]

    @torch.no_grad()
    def capture(self, batches: Sequence[int], depth: int, filters: DraftFilters = DraftFilters(0, False)) -> int:
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

    def _capture(self, bb: int, k: int, filters: DraftFilters) -> ChainGraph:
        """Capture the chain draft of `k` tokens for a batch bucket `bb`, reading its inputs from the draft window."""
        dev = self.device
        if self._window is None:
            rows = max(batch_bucket(self.config.graph_max_batch), bb)
            self._window = DraftWindow(rows, self.config.context, self.features.feature_dim, dev)
        window = self._window
        temp, top_p = torch.zeros(bb, device=dev), torch.ones(bb, device=dev)
        top_k = torch.zeros(bb, dtype=torch.int64, device=dev)
        keys, n_gen = torch.zeros(bb, dtype=torch.int64, device=dev), torch.zeros(bb, dtype=torch.int64, device=dev)

        def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            toks, feats, m, hist_len = window.inputs(bb)
            return self.chain_draft_no_sync(toks, feats, m, hist_len, temp, top_p, top_k, k, filters, (keys, n_gen))

        graph, out = self._record(run)
        self._sampled.pop((bb, k, filters), None)  # fresh buffers: the next draft copies the settings in
        return ChainGraph(graph, temp, top_p, top_k, out, keys, n_gen)

    def _record(self, run: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """Capture `run` into a CUDA graph in this proposer's memory pool -> (graph, its static outputs)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return record_graph(run, self.gen, self._pool, self.device)
