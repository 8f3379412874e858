"""CUDA graphs of the WHOLE plain decode step (rollout/decode_step.py: forward, logits processing, sampling with
each row's random stream, log-probs, commit), captured lazily per (batch bucket, attention-length bucket, sampling
mode) into the engine's one memory pool (`Engine.graph_pool`, shared with the verify graphs) and kept on the engine.

A captured step reads the engine's persistent row state and KV cache (fixed addresses) and leaves a `StepOut` of
static tensors. Randomness stays outside the graph: a sampled graph reads its Exp(1) draws from a static [B, V]
buffer that `run` refills right before each replay with the very call the eager step makes (`DecodeStep.noise`:
keyed on each row's stream and emitted count, stream-ordered after the previous replay's commit), so graph and eager
decoding emit the same tokens.

Capture warms the body up twice on a side stream first (allocator, lazy kernels, torch.compile); those runs really
commit tokens, so the row state is snapshotted before and restored after (the K/V they write sit at columns the
next real step overwrites); they read the noise buffer, which the next `run` refills. The capture itself is not
executed.
`capture_seconds` and `pool_bytes` (reserved-memory growth over all captures) say what the graphs cost; `clear()`
drops every graph and static buffer (the engine's `release_memory`, rollout/memory.py).
"""

from __future__ import annotations

import logging
import time

import torch

from worker.tlt.rollout.decode_step import GREEDY, DecodeStep, Mode, StepOut

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, step: DecodeStep, pool: object) -> None:
        self.step = step
        self.pool = pool  # torch.cuda.graph_pool_handle() shared by all of the engine's graphs
        self._graphs: dict[tuple[int, int, Mode], tuple[torch.cuda.CUDAGraph, StepOut]] = {}
        self._noise: dict[int, torch.Tensor] = {}  # batch -> static [B, V] Exp(1) draws read by sampled graphs
        self.capture_seconds = 0.0  # wall time of all captures (warm-up and compile included)
        self.pool_bytes = 0  # growth of reserved CUDA memory over all captures (static outputs and the pool)

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[tuple[int, int, Mode]]:  # (batch, tk, mode) of the captured graphs
        return list(self._graphs)

    def clear(self) -> int:
        """Drop every graph, its static outputs and the noise buffers -> the pool growth they had cost (bytes)."""
        self._graphs.clear()
        self._noise.clear()
        freed, self.pool_bytes = self.pool_bytes, 0
        return freed

    @property
    def compile_max_batch(self) -> int:
        return self.step.compile_max_batch

    def run(self, batch: int, tk: int, mode: Mode) -> StepOut:
        """One decode step for rows 0..batch-1 by replay (captured on first use)."""
        graph, out = self.capture(batch, tk, mode)
        if mode != GREEDY:  # the draws the eager step computes for these rows
            self._noise[batch].copy_(self.step.noise(batch))
        graph.replay()
        return out

    def _noise_buffer(self, batch: int, mode: Mode) -> torch.Tensor | None:
        if mode == GREEDY:
            return None
        if batch not in self._noise:
            w = self.step.model.head_weight
            self._noise[batch] = torch.ones(batch, w.shape[0], dtype=torch.float32, device=w.device)
        return self._noise[batch]

    def capture(self, batch: int, tk: int, mode: Mode) -> tuple[torch.cuda.CUDAGraph, StepOut]:
        """The graph of (batch, tk, mode), captured now if needed (without running it)."""
        key = (batch, tk, mode)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(batch, tk, mode)
        return entry

    def _capture(self, batch: int, tk: int, mode: Mode) -> tuple[torch.cuda.CUDAGraph, StepOut]:
        t0 = time.perf_counter()
        rows = self.step.rows
        noise = self._noise_buffer(batch, mode)
        saved_rows = rows.snapshot()  # the warm-up steps commit tokens: undone below
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(batch, tk, mode, noise)
        torch.cuda.current_stream().wait_stream(side)
        rows.restore(saved_rows)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved0 = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):  # type: ignore[arg-type]
            out = self.step(batch, tk, mode, noise)  # reads the noise buffer: no RNG inside the graph
        torch.cuda.synchronize()
        self.pool_bytes += max(torch.cuda.memory_reserved() - reserved0, 0)
        self.capture_seconds += time.perf_counter() - t0
        log.debug("captured decode graph batch=%d tk=%d mode=%s", batch, tk, mode)
        return graph, out
