"""CUDA graphs for the fixed-shape plain decode step, captured lazily per (batch bucket, attention-length bucket)
into one shared memory pool and kept on the engine (never in globals).

A captured step reads its inputs from the engine's persistent row state (`last[:B]`, `lens[:B]`: fixed addresses)
and writes its outputs (logits [B, V], final-norm hidden [B, H]) into static tensors that the engine reads after
`replay()`. Optional `torch.compile` of the step body before capture fuses the small kernels; it is used for small
batches only (`compile_max_batch`), where launch overhead dominates, and the engine then runs those at one fixed
attention length so that each batch bucket compiles once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

StepFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (batch, tk) -> (logits [B, V], hidden [B, H])


class DecodeGraphs:
    def __init__(self, step: StepFn, compile_max_batch: int = 0) -> None:
        self._step: StepFn = step
        self.compile_max_batch = compile_max_batch  # batches up to this use the compiled step (0 = never)
        self._compiled: StepFn | None = None
        if compile_max_batch > 0:
            self._compiled = torch.compile(step, dynamic=False)  # type: ignore[assignment]
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool: object | None = None
        self.capture_seconds = 0.0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, batch: int, tk: int) -> tuple[torch.Tensor, torch.Tensor]:  # -> logits [B, V], hidden [B, H]
        key = (batch, tk)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(batch, tk)
            self._graphs[key] = entry
        graph, logits, hidden = entry
        graph.replay()
        return logits, hidden

    def _capture(self, batch: int, tk: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        # warm-up on a side stream (allocator and lazy kernels settle before capture); the decode step only writes
        # K/V at each row's next column, which the next real step overwrites, so warming up on live rows is safe
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        step = self._compiled if self._compiled is not None and batch <= self.compile_max_batch else self._step
        with torch.cuda.stream(side):
            for _ in range(2):
                step(batch, tk)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):  # type: ignore[arg-type]
            logits, hidden = step(batch, tk)
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - t0
        log.debug("captured decode graph batch=%d tk=%d", batch, tk)
        return graph, logits, hidden
