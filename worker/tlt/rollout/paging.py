"""The rollout engine's pages (the paged KV layout, `EngineConfig.page_size`): admission by free pages, pages handed to
running sequences ahead of each loop iteration, and preemption when they run out.

Each iteration of `Engine.generate` runs either one speculative step or one window of up to `sync_every` plain
steps; before it, `reserve` gives every active row pages up to `lookahead` columns past its length bound (`row_hi`,
capped at prompt + max_new_tokens), so no step ever writes past a row's pages. When the free pages do not cover
that, the youngest sequence (last admitted) is preempted: its pages are copied to host memory with its row state,
its pages freed, and it waits in `Swapped` ahead of every new request; `swap_in` brings it back, bit for bit, when
its pages fit again. (Swapping rather than recomputing from prompt + tokens: the K/V and the row state come back
exactly as they were, so a greedy continuation is token-identical whatever kernels a recompute would have run, and
copying a sequence's K/V over PCIe costs less than its prefill at RL lengths.) Sampled rows draw from their own
streams (decoding/streams.py; the key travels in the row state, the draws are keyed on the emitted count): a
preempted sampled sequence continues exactly as it would have, the same sample.

New requests are admitted while their pages (prompt + lookahead; GRPO siblings only the pages past the shared full
ones) fit in the free pages less a watermark of 1% of the pool.
Run the tests: `python -m pytest tests/engine/test_engine_paged.py -q`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker.tlt.decoding.pages import PagePool
from worker.tlt.rollout.engine_state import EngineState
from worker.tlt.rollout.hidden_rows import flush_hidden
from worker.tlt.rollout.types import Request, RequestSampling


def lookahead(state: EngineState) -> int:
    """Columns one loop iteration can write past a row's length bound: a window of plain steps or a verify."""
    return state.config.sync_every + state.max_nodes + 1


def row_need(state: EngineState, hi: int | np.ndarray, cap: int | np.ndarray) -> np.ndarray:
    return np.minimum(np.asarray(hi) + lookahead(state), cap)


def pool_of(state: EngineState) -> PagePool:
    assert state.pages is not None, "the paged layout's operation on a row cache"
    return state.pages


@dataclass
class Swapped:
    """A preempted sequence: its K/V pages and row state in host memory, its host mirrors."""

    seq: tuple[int, int]
    sampling: RequestSampling
    host: tuple[int, int, int, int, int]  # row_hi, row_cap, row_known, row_plen, row_age
    rows: list[torch.Tensor]  # RowState.tensors() at its row
    k: list[torch.Tensor]  # per layer [pages, Hkv, P, D] on the host
    v: list[torch.Tensor]


def check_fits(state: EngineState, requests: Sequence[Request]) -> None:
    """Every sequence must fit alone in the pool at its full length (else preemption could never make room)."""
    pool = pool_of(state)
    for i, req in enumerate(requests):
        need = pool.pages_for(len(req.prompt) + req.params.max_new_tokens)
        if need > pool.usable:
            raise ValueError(f"request {i} needs {need} pages of {pool.page_size} columns at full length; the pool "
                             f"has {pool.usable}: raise EngineConfig.kv_pages")


def admit(state: EngineState, queue: deque[tuple[int, int]], requests: Sequence[Request]) -> list[tuple[int, int]]:
    """Take from the front of `queue` the sequences whose pages fit (module docstring) into the free rows."""
    pool = pool_of(state)
    budget = pool.free - (pool.usable // 100 if state.n_active else 0)  # an idle engine takes what fits
    rows_left = state.slots - state.n_active
    heads: set[int] = set()
    n = 0
    for r, _ in queue:
        if n >= rows_left:
            break
        req = requests[r]
        plen = len(req.prompt)
        need = pool.pages_for(int(row_need(state, plen, plen + req.params.max_new_tokens)))
        cost = need - plen // pool.page_size if r in heads else need  # siblings share the prompt's full pages
        if cost > budget:
            break
        budget -= cost
        heads.add(r)
        n += 1
    return [queue.popleft() for _ in range(n)]


def reserve(state: EngineState, swapped: list[Swapped]) -> int:
    """Pages for every active row up to its lookahead, preempting the youngest rows while they do not fit -> how
    many rows were preempted (appended to `swapped`)."""
    pool = pool_of(state)
    preempted = 0
    while state.n_active:
        n = state.n_active
        need = row_need(state, state.row_hi[:n], state.row_cap[:n])
        short = np.nonzero(pool.held[:n] * pool.page_size < need)[0]
        want = sum(pool.pages_for(int(need[r])) - int(pool.held[r]) for r in short)
        if want <= pool.free:
            for r in short:
                assert pool.grow(int(r), int(need[r]))
            break
        swapped.append(preempt(state, int(np.argmax(state.row_age[:n]))))
        preempted += 1
    state.flush_table()
    return preempted


def preempt(state: EngineState, row: int) -> Swapped:
    """Row `row` leaves for host memory: its pages and row state copied out, its pages freed, the last active row
    moved into its place."""
    flush_hidden(state)  # the hook's stash is indexed by row
    pool, cache, st = pool_of(state), state.cache, state.rows
    idx = torch.tensor(pool.row_pages(row), device=state.device)
    out = Swapped(
        seq=state.row_seq[row], sampling=state.row_sampling[row],
        host=(int(state.row_hi[row]), int(state.row_cap[row]), int(state.row_known[row]), int(state.row_plen[row]),
              int(state.row_age[row])),
        rows=[t[row].clone() for t in st.tensors()],
        k=[t.index_select(0, idx).cpu() for t in cache.k], v=[t.index_select(0, idx).cpu() for t in cache.v])
    pool.release(row)
    last = state.n_active - 1
    if row != last:
        st.move_rows(torch.tensor([last], device=state.device), torch.tensor([row], device=state.device))
        pool.move(last, row)
        hi = state.row_hi
        state.row_seq[row], state.row_sampling[row] = state.row_seq[last], state.row_sampling[last]
        hi[row], state.row_cap[row] = hi[last], state.row_cap[last]
        state.row_known[row], state.row_plen[row] = state.row_known[last], state.row_plen[last]
        state.row_age[row] = state.row_age[last]
    st.done[last] = True
    del state.row_seq[last], state.row_sampling[last]
    state.n_active = last
    state.hist_fresh, state.done_host = False, None
    state.rows_changed()
    return out


def swap_in(state: EngineState, swapped: list[Swapped]) -> int:
    """Bring preempted sequences back, oldest first, while their pages (and lookahead) fit -> how many."""
    pool, cache, st = pool_of(state), state.cache, state.rows
    swapped.sort(key=lambda s: s.host[4])
    n = 0
    while swapped and state.n_active < state.slots:
        sw = swapped[0]
        hi, cap, known, plen, age = sw.host
        held = sw.k[0].shape[0]
        row = state.n_active
        if not pool.grow(row, max(int(row_need(state, hi, cap)), held * pool.page_size)):
            break
        swapped.pop(0)
        idx = torch.tensor(pool.row_pages(row)[:held], device=state.device)
        for t, h in zip((*cache.k, *cache.v), (*sw.k, *sw.v), strict=True):
            t.index_copy_(0, idx, h.to(state.device))
        for t, saved in zip(st.tensors(), sw.rows, strict=True):
            t[row] = saved
        state.row_seq.append(sw.seq)
        state.row_sampling.append(sw.sampling)
        state.row_hi[row], state.row_cap[row], state.row_known[row] = hi, cap, known
        state.row_plen[row], state.row_age[row] = plen, age
        state.n_active += 1
        n += 1
    if n:
        state.hist_fresh, state.done_host = False, None
        state.rows_changed()
        state.flush_table()
    return n
