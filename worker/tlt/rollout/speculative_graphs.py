"""CUDA graphs of the speculative step after the proposal (rollout/speculative_body.py: tree mask, the verify forward,
exact acceptance, K/V compaction, commit, stats), one per (batch bucket, verify width, depth bound, topk, sampling
mode, drafter probs or not), captured lazily or by `warmup()` into one shared memory pool (the engine's
`graph_pool`) and kept on the engine. The graphs attend over the whole cache (one graph per arm shape, not per
length), which costs little at the batches SD runs at.

Eager on an H200, the verify forward of the 30-layer SmolLM2 cost 31-46 ms (launches, not FLOPs), and once it was
graphed the acceptance and bookkeeping after it still launched ~400 kernels from Python per step. Here the whole
body is one replay. Outside it, per step: the proposal is copied into static buffers (rows past the batch and
nodes past a row's width are padding, parents -1, count 1), the randomness is refilled into static buffers with the
rows' own streams (rollout/speculative_body.spec_draws, keyed on each row's emitted count, so every replay samples afresh), and the caller reads the packed result once.

Capture runs the body twice first, on the proposal already copied in (allocator, lazy kernels); those runs really
commit, so the row state is snapshotted before and restored after; the K/V they write sit at columns the replay
overwrites. (On empty inputs, as `warmup()` uses, every row counts as padding and gets scratch K/V at columns 0..W-1:
harmless only while no row is live, which warmup() checks.)

    graphs = VerifyGraphs(pool)                   # the engine's (rollout/memory.py: CUDA with cuda_graphs only)
    graphs.warmup(state, {8: [(7, 6, 1, True)]}, mode)   # per batch bucket: (width, depth, topk, q)
    out = graphs.run(state, proposal, batch, width=7, depth=6, topk=1)   # SpecOut of static tensors

Run the GPU test: `python -m pytest tests/spec/test_spec_verify_graphs.py -q -m gpu`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.rollout.decode_step import GREEDY, Mode
from worker.tlt.rollout.engine_state import EngineState
from worker.tlt.rollout.speculative_body import SpecInputs, SpecOut, spec_draws, verify_commit

log = logging.getLogger(__name__)

Key = tuple[int, int, int, int, Mode, bool]  # (rows, width, depth, topk, mode, has draft probs)


@dataclass
class _Entry:
    inp: SpecInputs  # static inputs
    out: SpecOut | None = None  # static outputs (set by the capture)
    graph: torch.cuda.CUDAGraph | None = None  # anything with replay() that refreshes `out`


class VerifyGraphs:
    def __init__(self, pool: object | None = None) -> None:
        self._pool = pool  # shared with the decode graphs when the engine passes its pool
        self._entries: dict[Key, _Entry] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0  # device memory reserved by the captures (pool growth and static buffers)

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Key]:
        return list(self._entries)

    def clear(self) -> int:
        """Drop every graph with its static buffers (the engine's `release_memory`) -> the bytes they had cost."""
        self._entries.clear()
        freed, self.pool_bytes = self.pool_bytes, 0
        return freed

    def warmup(self, state: EngineState, plan: Mapping[int, Sequence[tuple[int, int, int, bool]]], mode: Mode) -> float:
        """Capture ahead of a timed run (every row empty), per engine batch bucket, the graphs of the shapes in
        `plan[bucket]`: (width, depth, topk, drafter sends q) for the sampling `mode`. Returns the seconds spent."""
        if state.n_active:
            raise RuntimeError("warm up the verify graphs before generate(), with every row empty")
        t0 = time.perf_counter()
        for b, shapes in sorted(plan.items()):
            for width, depth, topk, q in shapes:
                self._entry(state, (b, width, min(depth, width - 1), topk, mode, q and mode != GREEDY))
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    @torch.no_grad()
    def run(self, state: EngineState, prop: DraftProposal, batch: int, *, width: int, depth: int, topk: int) -> SpecOut:
        """The body for rows 0..batch-1 by replay (captured on first use); outputs are static: read them before
        the next replay."""
        b, n = prop.tokens.shape
        if b != batch or n > width:
            raise ValueError(f"proposal [{b}, {n}] does not fit [{batch}, {width}]")
        has_q = prop.draft_probs is not None and state.mode != GREEDY
        key = (state.bucket(batch), width, depth, topk, state.mode, has_q)
        entry = self._entries.get(key)
        fresh = entry is None
        if entry is None:
            entry = _Entry(self._buffers(state, key))
        inp = entry.inp
        # fill first: a capture warms the body up on these inputs (with n_rows = 0 it would write its scratch
        # K/V into columns 0.. of live rows)
        inp.tokens.zero_()
        inp.tokens[:b, :n] = prop.tokens
        inp.parents.fill_(-1)
        inp.parents[:b, :n] = prop.parents
        inp.counts.fill_(1)
        inp.counts[:b] = prop.counts
        if inp.draft_probs is not None and prop.draft_probs is not None:
            inp.draft_probs[:b, :n] = prop.draft_probs
        inp.n_rows.fill_(b)
        if inp.uniforms is not None and inp.noise is not None:  # this replay's draws: what the eager body computes
            uniforms, noise = spec_draws(state.rows, inp.tokens.shape[0], depth, topk, inp.noise.shape[1])
            inp.uniforms.copy_(uniforms)
            inp.noise.copy_(noise)
        if fresh:
            self._entries[key] = self._capture(state, key, entry)
        assert entry.graph is not None
        entry.graph.replay()
        assert entry.out is not None
        return entry.out

    # ------------------------------------------------------------------------------------------------ internals
    def _entry(self, state: EngineState, key: Key) -> _Entry:
        """The graph of `key`, captured now on empty inputs if missing (warm-up only: every row must be empty)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self._capture(state, key, _Entry(self._buffers(state, key)))
        return entry

    def _buffers(self, state: EngineState, key: Key) -> SpecInputs:
        rows, width, depth, topk, mode, has_q = key
        dev = state.device
        vocab = state.model.head_weight.shape[0]
        z = torch.zeros((rows, width), dtype=torch.int64, device=dev)
        sampled = mode != GREEDY
        return SpecInputs(
            tokens=z, parents=torch.full_like(z, -1), counts=torch.ones(rows, dtype=torch.int64, device=dev),
            draft_probs=torch.full((rows, width, vocab), 1.0 / vocab, device=dev) if has_q else None,
            n_rows=torch.zeros(1, dtype=torch.int64, device=dev),
            uniforms=torch.rand(rows, max(depth, 1) * max(topk, 1), device=dev) if sampled else None,
            noise=torch.ones(rows, vocab, device=dev) if sampled else None,
        )

    def _capture(self, state: EngineState, key: Key, entry: _Entry) -> _Entry:
        rows, width, depth, topk, mode, _ = key
        t0 = time.perf_counter()
        tk = state.cache.max_len

        def body() -> SpecOut:
            return verify_commit(state, entry.inp, depth=depth, topk=topk, mode=mode, tk=tk, chain=topk == 1)

        # warm-up (allocator, lazy kernels) on the filled inputs, on a side stream on CUDA; the runs really commit,
        # so the row state is put back; their K/V land in columns the replay rewrites
        saved = state.rows.snapshot()
        cuda = state.device.type == "cuda"
        side = torch.cuda.Stream() if cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for _ in range(2):
                body()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        state.rows.restore(saved)
        self._record(state, entry, body)
        self.capture_seconds += time.perf_counter() - t0
        log.debug("captured verify graph %s", key)
        return entry

    def _record(self, state: EngineState, entry: _Entry, body: Callable[[], SpecOut]) -> None:
        """Capture `body` into entry.graph (static outputs into entry.out)."""
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        entry.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(entry.graph, pool=self._pool):  # type: ignore[arg-type]
            entry.out = body()
        torch.cuda.synchronize()
        self.pool_bytes += torch.cuda.memory_reserved() - before
