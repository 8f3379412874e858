"""CUDA graphs for the speculative step's verify forward, one per (batch bucket, verify width) -- and per attention
length bucket when `attn_bucket` is set; by default a graph attends over the whole cache, which costs little at the
batches SD runs at and keeps the graph count (and their static logits) small -- captured lazily or by `warmup()`
into one shared memory pool (the engine's `graph_pool` when it has one) and kept on the engine.

Eager, a verify forward of the 30-layer SmolLM2 costs 31-46 ms on an H200 where a graphed plain step costs 3.8 ms:
launches, not FLOPs. A graph replays the same forward for fixed shapes, so a proposal is first written into static
buffers (`_Entry`), outside the graph:

- rows 0..B-1 are the active batch: node tokens, positions lens + depth, K/V columns lens + i, and the tree mask
  (the cached prefix plus each node's ancestors, rollout/speculative.py);
- nodes n..W-1 of a real row (a proposal narrower than the graph's width W, e.g. an n-gram chain that found a
  short match) are padding: token 0 at position lens, K/V written at lens + i (scratch columns past the row's
  accepted run, overwritten later), attending only the prefix and themselves; the verifier never reads them;
- rows B..bucket-1 are free rows (the engine keeps active sequences in rows 0..n-1, so these are done or empty):
  they write K/V into their own columns 0..W-1 (a free row is prefilled again before it is read) and attend only
  themselves, so no row ever attends a fully masked row (no NaN).

The outputs (logits [bucket, W, V], hidden [bucket, W, (k+1)H]) are static tensors; the caller reads [:B, :n] before the
next replay. `capture_seconds` and `pool_bytes` (device memory the captures added) go into the report table ("graph
memory and capture time").

    graphs = VerifyGraphs.for_engine(engine)      # None off CUDA or with cuda_graphs off
    graphs.warmup(engine, max_batch=160, widths=(4, 7))   # before a timed rollout (rows must be empty)
    logits, hidden = graphs.run(tokens, depth, anc, lens, bucket=16, width=7, hi=300)

Run the GPU test: `python -m pytest tests/spec/test_spec_verify_graphs.py -q -m gpu`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.decode_step import hook_rows
from worker.tlt.rollout.kv_cache import KVCache

if TYPE_CHECKING:
    from worker.tlt.rollout.engine import Engine

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    tokens: torch.Tensor  # [Bb, W] int64
    pos: torch.Tensor  # [Bb, W] int64
    widx: torch.Tensor  # [Bb, W] int64 K/V column of each node
    mask: torch.Tensor  # [Bb, W, Tk] bool
    logits: torch.Tensor  # [Bb, W, V] (output)
    hidden: torch.Tensor  # [Bb, W, (k+1)H] (output) hook rows (rollout/decode_step.hook_rows)
    graph: torch.cuda.CUDAGraph | None = None  # set by the capture


class VerifyGraphs:
    def __init__(self, model: Transformer, cache: KVCache, pool: object | None = None,
                 attn_bucket: int | None = None, capture_layers: tuple[int, ...] = ()) -> None:
        """attn_bucket: attention columns rounded up to a multiple of this (one graph per length bucket); None =
        the whole cache (one graph per (batch bucket, width)). capture_layers: the hidden output also carries those
        layers' inputs (EngineConfig.capture_layers)."""
        self.model, self.cache = model, cache
        self.capture_layers = capture_layers
        self.attn_bucket = attn_bucket
        self._pool = pool  # shared with the decode graphs when the engine passes its pool
        self._entries: dict[tuple[int, int, int], _Entry] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0  # device memory reserved by the captures (pool growth, static buffers excluded)

    @classmethod
    def for_engine(cls, engine: Engine) -> VerifyGraphs | None:
        if engine.device.type != "cuda" or not engine.config.cuda_graphs:
            return None
        return cls(engine.model, engine.cache, getattr(engine, "graph_pool", None),
                   capture_layers=engine.config.capture_layers)

    def attention_len(self, hi: int, width: int) -> int:
        """Attention columns of a graph for rows whose lengths are <= hi, `width` nodes each."""
        t = self.cache.max_len
        if self.attn_bucket is None:
            return t
        need = max(hi + width, 1)
        return min((need + self.attn_bucket - 1) // self.attn_bucket * self.attn_bucket, t)

    def warmup(self, engine: Engine, max_batch: int, widths: Sequence[int]) -> float:
        """Capture every (engine batch bucket <= max_batch, width) graph ahead of a timed run (all rows empty: the
        captures write scratch K/V into them). Returns the seconds spent."""
        if engine.n_active:
            raise RuntimeError("warm up the verify graphs before generate(), with every row empty")
        t0 = time.perf_counter()
        dev = self.cache.k[0].device
        buckets = sorted({engine.bucket(b) for b in (*engine.config.batch_buckets, max_batch) if b <= max_batch})
        his = [0] if self.attn_bucket is None else list(range(0, engine.max_len + 1, self.attn_bucket))
        for b in buckets:
            for w in widths:
                for hi in his:
                    z = torch.zeros((b, w), dtype=torch.int64, device=dev)
                    anc = torch.eye(w, dtype=torch.bool, device=dev).expand(b, w, w)
                    self.run(z, z, anc, torch.full((b,), hi, dtype=torch.int64, device=dev), bucket=b, width=w,
                             hi=hi)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[tuple[int, int, int]]:
        """(batch bucket, verify width, attention length) of every captured graph."""
        return sorted(self._entries)

    @torch.no_grad()
    def run(
        self,
        tokens: torch.Tensor,  # [B, n] int64 proposal nodes (root first)
        depth: torch.Tensor,  # [B, n] int64 node depths (0 for the root and padding)
        anc: torch.Tensor,  # [B, n, n] bool ancestor-or-self mask
        lens: torch.Tensor,  # [B] int64 cached tokens per row (the root's position)
        *,
        bucket: int,  # rows computed (>= B; rows B.. are free rows)
        width: int,  # nodes per row in the graph (>= n)
        hi: int,  # an upper bound of lens (host-side: picks the attention length without a sync)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [B, n, V], hidden [B, n, (k+1)H] (views into static outputs)
        b, n = tokens.shape
        tk = self.attention_len(hi, width)
        if b > bucket or n > width:
            raise ValueError(f"proposal [{b}, {n}] does not fit the graph [{bucket}, {width}]")
        key = (bucket, width, tk)
        entry = self._entries.get(key)
        fresh = entry is None
        if entry is None:
            entry = self._buffers(bucket, width, tk)
        self._fill(entry, tokens, depth, anc, lens)
        if fresh:
            entry = self._capture(entry, key)
            self._entries[key] = entry
        assert entry.graph is not None
        entry.graph.replay()
        return entry.logits[:b, :n], entry.hidden[:b, :n]

    # ------------------------------------------------------------------------------------------------ internals
    def _buffers(self, bucket: int, width: int, tk: int) -> _Entry:
        dev = self.cache.k[0].device
        z = torch.zeros((bucket, width), dtype=torch.int64, device=dev)
        mask = torch.zeros((bucket, width, tk), dtype=torch.bool, device=dev)
        empty = torch.empty(0, device=dev)
        return _Entry(z, z.clone(), z.clone(), mask, empty, empty)

    def _fill(self, e: _Entry, tokens: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor,
              lens: torch.Tensor) -> None:
        """Write the proposal into the static inputs (module docstring: real rows, padded nodes, free rows)."""
        b, n = tokens.shape
        bucket, width, tk = e.mask.shape
        node = torch.arange(width, device=lens.device)
        e.tokens.zero_()
        e.tokens[:b, :n] = tokens
        e.pos[:b] = lens[:, None]
        e.pos[:b, :n] += depth
        e.pos[b:] = node[None, :]
        e.widx[:b] = lens[:, None] + node[None, :]
        e.widx[b:] = node[None, :]
        e.mask.zero_()
        e.mask[:b] = torch.arange(tk, device=lens.device)[None, None, :] < lens[:, None, None]
        e.mask[:b, :n].scatter_(2, e.widx[:b, None, :n].expand(b, n, n), anc)
        e.mask.scatter_(2, e.widx[:, :, None], True)  # every node sees itself (padded nodes, free rows)

    def _forward(self, e: _Entry) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden, cap = self.model.forward_hidden(e.tokens, e.pos, self.cache, write_idx=e.widx,
                                                        attn_mask=e.mask, layers=self.capture_layers)
        return logits, hook_rows(hidden, cap, self.capture_layers)

    def _capture(self, e: _Entry, key: tuple[int, int, int]) -> _Entry:
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        # warm-up on a side stream; it writes the same K/V the replay writes (real rows: this step's nodes at
        # lens + i; free rows: their own scratch columns), so running it on live rows is harmless
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(e)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        e.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(e.graph, pool=self._pool):  # type: ignore[arg-type]
            e.logits, e.hidden = self._forward(e)
        torch.cuda.synchronize()
        self.pool_bytes += torch.cuda.memory_reserved() - before
        self.capture_seconds += time.perf_counter() - t0
        log.debug("captured verify graph bucket=%d width=%d tk=%d", *key)
        return e
