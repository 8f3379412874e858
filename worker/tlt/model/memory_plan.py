"""How many KV-cache rows fit on a GPU once the model is loaded: `plan_kv(args, max_len, free_bytes=...)` keeps back
what the engine needs beside weights and cache from the given free bytes (job_spec_translate.engine_config passes the
device's free memory less the update's peak when `rollout.kv_cache_gb` is unset on CUDA).

A 7B model in bf16 on an H200 leaves ~125 GiB free after its 15 GB of weights; at 57 KB of K/V per token
(Qwen2.5-7B: 28 layers x 2 x 4 KV heads x 128 x 2 bytes) that is ~2M cached tokens after the working memory, e.g.
493 rows of 4,096 columns, where a fixed 8 GB budget holds 35. The engine takes the result as
`EngineConfig.max_slots`. With the paged layout (`rollout.kv_page_size`), `plan_pages` gives the pool's pages
from the same memory instead: sequences take pages as they grow, so the rows planned for the longest sequence no
longer cap how many run at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.tlt.model.args import ModelArgs
from worker.tlt.model.roofline import kv_bytes

FIXED_RESERVE = 2 << 30  # cuBLAS workspaces, CUDA graph pools, Triton scratch, allocator fragmentation


@dataclass(frozen=True)
class KvPlan:
    slots: int  # cache rows of max_len columns
    cache_bytes: int  # what those rows take
    reserved_bytes: int  # kept free for the engine's working memory
    free_bytes: int  # what the device had free when planned


def working_bytes(args: ModelArgs, max_batch: int, prefill_tokens: int, dtype_bytes: int) -> int:
    """Peak working memory beside weights and cache: one prefill forward's activations (q|k|v, gate|up, the SwiGLU
    product and a few hidden-width tensors per token, one layer at a time), the sampler's fp32 [B, V] tensors
    (logits, probabilities, noise) at max_batch rows, and FIXED_RESERVE."""
    per_token = (args.n_heads + 2 * args.n_kv_heads) * args.hd + 3 * args.intermediate_size + 4 * args.dim
    return prefill_tokens * per_token * dtype_bytes + 3 * max_batch * args.vocab_size * 4 + FIXED_RESERVE


def plan_kv(args: ModelArgs, max_len: int, *, free_bytes: int, dtype_bytes: int = 2, max_batch: int = 256,
            prefill_tokens: int = 16384, fraction: float = 0.9, max_slots: int | None = None) -> KvPlan:
    """Rows of `max_len` columns that fit in `fraction` of `free_bytes` after the working memory (at most
    `max_slots`). A ValueError when not even one row fits, naming what would."""
    if not 0.0 < fraction <= 1.0 or max_len < 1:
        raise ValueError("fraction must be in (0, 1] and max_len >= 1")
    reserve = working_bytes(args, max_batch, prefill_tokens, dtype_bytes)
    row = kv_bytes(args, batch=1, context=max_len, dtype_bytes=dtype_bytes)
    slots = (int(free_bytes * fraction) - reserve) // row
    if max_slots is not None:
        slots = min(slots, max_slots)
    if slots < 1:
        raise ValueError(f"no KV-cache row of {max_len} columns fits: {free_bytes / 2**30:.1f} GiB free, "
                         f"{reserve / 2**30:.1f} GiB kept for activations and graphs, {row / 2**20:.0f} MiB per row; "
                         "shorten max_len, lower max_batch / prefill_tokens, or free device memory")
    return KvPlan(slots=slots, cache_bytes=slots * row, reserved_bytes=reserve, free_bytes=free_bytes)


def plan_pages(args: ModelArgs, page_size: int, max_len: int, *, free_bytes: int, dtype_bytes: int = 2,
               max_batch: int = 256, prefill_tokens: int = 16384, fraction: float = 0.9) -> int:
    """Pages of `page_size` columns that fit in `fraction` of `free_bytes` after the working memory (the paged
    layout's pool; one is scratch). A ValueError when not one sequence of `max_len` columns fits."""
    reserve = working_bytes(args, max_batch, prefill_tokens, dtype_bytes)
    page = kv_bytes(args, batch=1, context=page_size, dtype_bytes=dtype_bytes)
    pages = (int(free_bytes * fraction) - reserve) // page
    if pages - 1 < -(-max_len // page_size):
        raise ValueError(f"no sequence of {max_len} columns fits in pages of {page_size}: {free_bytes / 2**30:.1f} "
                         f"GiB free, {reserve / 2**30:.1f} GiB kept for activations and graphs")
    return pages

