"""Free the rollout engine's KV cache, and every CUDA graph that reads it, while the engine is idle (the policy update
of a colocated RL step), and bring it back for the next rollout.

    freed = engine.release_memory()   # bytes: the KV cache + the graphs' pool growth; generate() raises until ...
    engine.restore_memory()           # ... the same shapes are allocated again (zeros, as at construction)

verl frees vLLM's cache with sleep mode (a cuMem allocator that keeps the virtual addresses, so captured graphs stay
valid). We do the plain thing: the graphs bake the cache's addresses in, so they go too and are captured again on
first use (as after construction without `Engine.warmup`), which costs capture time in every RL step's rollout.
Worth it when the update needs the memory (`rollout.release_kv_for_update`).

What goes: the K/V tensors (replaced by empty tensors inside the one `KVCache` object that the engine, its decode step
and the verify body share, so no stale reference keeps them alive), the decode, verify and prefill graphs with their
static buffers and their memory pool, and what a drafter keeps for the cache's layout (`Proposer.release`: a
small-model drafter's own KV cache, re-allocated by its next proposal).
What stays: the row state, the block table and the page pool (every page free between rollouts), the generator (the next generate() draws its base seed from it), the EAGLE proposer's chain graphs (they
read its feature ring and its own buffers, not the engine's cache; a few MB).
Run the tests: `python -m pytest tests/engine/test_engine_release.py -q` (and `-m gpu` on a GPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from worker.tlt.decoding.kv_cache import KVCache
from worker.tlt.rollout.engine_state import EngineState
from worker.tlt.rollout.graphs import DecodeGraphs
from worker.tlt.rollout.prefill_graphs import PrefillGraphs
from worker.tlt.rollout.speculative_graphs import VerifyGraphs
from worker.tlt.speculative.proposers.protocol import Proposer


@dataclass
class EngineGraphs:
    """One memory pool and the decode / verify / prefill graph sets captured into it (all None off CUDA or with
    cuda_graphs off)."""

    pool: object | None = None
    decode: DecodeGraphs | None = None
    verify: VerifyGraphs | None = None
    prefill: PrefillGraphs | None = None

    def _sets(self) -> list[DecodeGraphs | VerifyGraphs | PrefillGraphs]:
        return [g for g in (self.decode, self.verify, self.prefill) if g is not None]

    def clear(self) -> int:
        """Drop every graph with its static buffers -> the bytes they had cost; the sets stay empty after."""
        return sum(g.clear() for g in self._sets())

    def captured(self) -> tuple[int, float]:
        """(graphs held, seconds spent capturing them: first-use kernel compiles of their warm-up runs included)."""
        return sum(len(g) for g in self._sets()), sum(g.capture_seconds for g in self._sets())


def kv_released(cache: KVCache) -> bool:
    """True while the cache's tensors are the empty placeholders `release` leaves (a live cache is never empty)."""
    return any(t.numel() == 0 for t in (*cache.k, *cache.v))


def new_graphs(state: EngineState) -> EngineGraphs:
    """A fresh memory pool and empty decode / verify / prefill graph sets (captured on first use), on CUDA with
    cuda_graphs."""
    if state.device.type != "cuda" or not state.config.cuda_graphs:
        return EngineGraphs()
    pool = torch.cuda.graph_pool_handle()
    return EngineGraphs(pool, DecodeGraphs(state.step, pool), VerifyGraphs(pool), PrefillGraphs(pool))


def release(state: EngineState, graphs: EngineGraphs, proposers: Iterable[Proposer]) -> int:
    """Free the KV cache and what reads it -> bytes freed (cache, drafter caches, graph pool growth as the captures
    measured it); 0 when already released. The caller drops `graphs` (emptied here, in case someone still holds
    them) and makes new ones at restore."""
    if state.n_active:
        raise RuntimeError("release_memory() with sequences still active: call it between generate() calls")
    cache = state.cache
    if kv_released(cache):
        return 0
    freed = cache.nbytes
    empty = torch.empty(0, device=state.device, dtype=state.dtype)
    cache.k[:] = [empty] * len(cache.k)  # in place: every holder of this KVCache sees the release
    cache.v[:] = [empty] * len(cache.v)
    freed += graphs.clear()
    for p in {id(x): x for x in proposers}.values():
        freed += p.release()
    if state.device.type == "cuda":
        torch.cuda.synchronize(state.device)
        torch.cuda.empty_cache()
    return freed


def restore(state: EngineState) -> bool:
    """Allocate the cache's shapes again (zeros, as at construction) -> True; False (a no-op) when live. The caller
    attaches fresh graph sets."""
    cache = state.cache
    if not kv_released(cache):
        return False
    rows, pool = state.rows, state.pages  # hold the cache's rows, columns (T) and pages for the engine's lifetime
    fresh = KVCache.allocate(state.model.args, rows.slots, rows.max_len, state.device, state.dtype,
                             page_size=pool.page_size if pool is not None else None,
                             n_pages=pool.n_pages if pool is not None else None)
    cache.k[:], cache.v[:] = fresh.k, fresh.v
    return True
