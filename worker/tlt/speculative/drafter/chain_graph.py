"""CUDA graphs of the EAGLE proposer's chain draft: one per (batch bucket, depth), batches padded to the next power
of two; `record_graph` warms a function up on a side stream and captures it with the proposer's generator
registered. A sampled draft's randomness comes from the rows' stream keys and emitted counts (`keys`, `n_gen`:
static inputs the proposer fills before each replay; kernels.draft_noise), so each replay draws afresh. A graph's outputs are static buffers: a proposal read from them
is valid until the next replay.

Run the tests: `python -m pytest tests/drafter/test_drafter_chain_graph.py -q` (the capture itself: `-m gpu`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ChainGraph:
    """A captured chain draft for one (batch bucket, depth): the rows' sampling settings the host fills, static
    outputs."""

    graph: Any  # torch.cuda.CUDAGraph (anything with replay()); its inputs are the proposer's DraftWindow
    temp: torch.Tensor  # [Bb] float32
    top_p: torch.Tensor  # [Bb] float32
    top_k: torch.Tensor  # [Bb] int64
    out: tuple[torch.Tensor, ...]  # tokens [Bb, k+1], parents [Bb, k+1], counts [Bb], draft_probs [Bb, k+1, V]
    keys: torch.Tensor  # [Bb] int64 the rows' stream keys (DraftContext.streams)
    n_gen: torch.Tensor  # [Bb] int64 their emitted counts


def batch_bucket(batch: int) -> int:
    """The graph batch a batch of this size runs in: the next power of two."""
    return 1 << max(batch - 1, 0).bit_length()


def record_graph(run: Callable[[], tuple[torch.Tensor, ...]], gen: torch.Generator, pool: object,
                 device: torch.device) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """Warm up `run` on a side stream, then capture it into a CUDA graph in `pool` -> (graph, its static outputs)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up: lazy kernels and the allocator settle before capture
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(gen)  # each replay advances the proposer's generator
    with torch.cuda.graph(graph, pool=pool):  # type: ignore[arg-type]
        out = run()
    torch.cuda.synchronize(device)
    return graph, out
