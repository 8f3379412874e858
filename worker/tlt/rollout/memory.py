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
static buffers and their memory pool, and a small-model drafter's own KV cache (re-allocated by its next proposal).
What stays: the row state, the generator (the sampling stream just continues), the EAGLE proposer's chain graphs (they
read its feature ring and its own buffers, not the engine's cache; a few MB).
Run the tests: `python -m pytest tests/engine/test_engine_release.py -q` (and `-m gpu` on a GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.tlt.rollout.graphs import DecodeGraphs
from worker.tlt.rollout.kv_cache import KVCache
from worker.tlt.rollout.prefill_graphs import PrefillGraphs
from worker.tlt.rollout.verify_graphs import VerifyGraphs
from worker.tlt.spec.small_model import SmallModelProposer

if TYPE_CHECKING:
    from worker.tlt.rollout.engine import Engine


def kv_released(cache: KVCache) -> bool:
    """True while the cache's tensors are the empty placeholders `release` leaves (a live cache is never empty)."""
    return any(t.numel() == 0 for t in (*cache.k, *cache.v))


def attach_graphs(engine: Engine) -> None:
    """A fresh memory pool and empty decode / verify / prefill graph sets (captured on first use), on CUDA with
    cuda_graphs."""
    on = engine.device.type == "cuda" and engine.config.cuda_graphs
    engine.graph_pool = torch.cuda.graph_pool_handle() if on else None
    engine.graphs = DecodeGraphs(engine.step, engine.graph_pool) if on else None
    engine.verify_graphs = VerifyGraphs.for_engine(engine) if on else None  # reads engine.graph_pool
    engine.prefill_graphs = PrefillGraphs(engine.graph_pool) if on else None


def release(engine: Engine) -> int:
    """Free the KV cache and what reads it -> bytes freed (cache, small-model drafter caches, graph pool growth as
    the captures measured it); 0 when already released."""
    if engine.n_active:
        raise RuntimeError("release_memory() with sequences still active: call it between generate() calls")
    cache = engine.cache
    if kv_released(cache):
        return 0
    freed = cache.nbytes
    empty = torch.empty(0, device=engine.device, dtype=engine.dtype)
    cache.k[:] = [empty] * len(cache.k)  # in place: every holder of this KVCache sees the release
    cache.v[:] = [empty] * len(cache.v)
    for graphs in (engine.graphs, engine.verify_graphs, engine.prefill_graphs):
        if graphs is not None:
            freed += graphs.clear()  # emptied too, in case someone else still holds the object
    engine.graph_pool, engine.graphs, engine.verify_graphs, engine.prefill_graphs = None, None, None, None
    for p in {id(x): x for x in [engine.proposer, *engine.proposers.values()] if x is not None}.values():
        if isinstance(p, SmallModelProposer) and p.cache is not None:
            freed += p.cache.nbytes
            p.cache = None
            p.reset()  # it re-feeds whole histories into the cache it allocates next
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
        torch.cuda.empty_cache()
    return freed


def restore(engine: Engine) -> None:
    """Allocate the cache's shapes again (zeros, as at construction) and fresh empty graph sets; no-op when live."""
    cache = engine.cache
    if not kv_released(cache):
        return
    rows = engine.rows  # holds the cache's row count and column count (T) for the engine's lifetime
    fresh = KVCache.allocate(engine.model.args, rows.slots, rows.max_len, engine.device, engine.dtype)
    cache.k[:], cache.v[:] = fresh.k, fresh.v
    attach_graphs(engine)
