"""CUDA graphs of prefill chunks: the forward of c prompts padded to s tokens into cache rows row0 .. row0+c-1
(rollout/prefill.py's `chunk_forward`: the fused kernels or torch's), one graph per (row0, c, s, captured layers).

A batch-1 GSM8K prompt is ~155 Triton launches and a few torch ops: ~10 ms of host work for well under a
millisecond of GPU work on an H200, i.e. 6% of a 256-token batch-1 decode; batch 8 in torch was 32 ms.
Replayed, it is two input copies and one launch. Only chunks of at most GRAPH_PREFILL_TOKENS padded
tokens come here (small admissions); a rollout's big chunks are not launch-bound.

The first chunk of a shape runs eagerly -- that run IS the prefill, writing the real K/V -- and its graph is captured
right after (not executed: capture only records), so that the next prefill of the same shape replays. The kernels
take row0 as a launch argument, hence the key; at most `limit` graphs are kept (later new shapes stay eager), in the
engine's one memory pool. They bake in the cache's addresses: `clear()` drops them (rollout/memory.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

# (row0, ids [c, s], plen [c]) -> (logits [c, 1, V], final-norm hidden [c, s, H], {layer: hidden entering it})
ChunkForward = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]]
Outputs = tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]
Key = tuple[int, int, int, tuple[int, ...]]  # (row0, c, s, captured layers)
Entry = tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, Outputs]  # graph, static ids, static plen, outputs
log = logging.getLogger(__name__)


class PrefillGraphs:
    def __init__(self, pool: object, limit: int = 16) -> None:
        self.pool = pool
        self.limit = limit
        self._graphs: dict[Key, Entry] = {}
        self._refused: set[Key] = set()
        self.capture_seconds = 0.0  # wall time of all captures (their kernels warmed up by the eager run before)

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> int:
        self._graphs.clear()
        return 0  # their pool growth is not measured (the activations of at most GRAPH_PREFILL_TOKENS tokens)

    def __call__(self, body: ChunkForward, row0: int, ids: torch.Tensor, plen: torch.Tensor,
                 layers: tuple[int, ...] = ()) -> Outputs:
        """The chunk's forward `body`: replayed when its shape was seen, else run eagerly (and captured, up to
        `limit`). `layers`: the captured layers the body returns (part of the key). Replayed outputs are static: read
        them before the next prefill. (The body is passed per call, not kept: an engine holding graphs that hold the
        engine would be a reference cycle, freed by the cyclic GC at any moment -- once inside another graph's
        capture, which a graph's destruction there invalidates.)"""
        key: Key = (row0, ids.shape[0], ids.shape[1], layers)
        entry = self._graphs.get(key)
        if entry is not None:
            graph, s_ids, s_plen, out = entry
            s_ids.copy_(ids)
            s_plen.copy_(plen)
            graph.replay()
            return out
        out = body(row0, ids, plen)
        if len(self._graphs) < self.limit and key not in self._refused:
            t0 = time.perf_counter()
            try:
                self._graphs[key] = self._capture(body, row0, ids, plen)
            except RuntimeError as e:  # e.g. an op that syncs with the host: this shape stays eager
                self._refused.add(key)
                log.warning("prefill graph %s not captured (%s): eager", key, e)
            self.capture_seconds += time.perf_counter() - t0
        return out

    def _capture(self, body: ChunkForward, row0: int, ids: torch.Tensor, plen: torch.Tensor) -> Entry:
        s_ids, s_plen = ids.clone(), plen.clone()
        graph = torch.cuda.CUDAGraph()
        # the eager run just before warmed every kernel of this shape up (Triton compiled, allocator primed)
        with torch.cuda.graph(graph, pool=self.pool):  # type: ignore[arg-type]
            out = body(row0, s_ids, s_plen)
        return graph, s_ids, s_plen, out
