"""The paged KV cache's host allocator (decoding/pages.py: pages as rows grow, freed at the end, shared prompt pages
with reference counts, a private copy of the partial page, rows moved with their pages) and the device cache through
its block table (decoding/kv_cache.py: the torch forward and the accepted-node compaction give the row layout's
results on a paged cache).
Run: python -m pytest tests/engine/test_engine_pages.py -q"""

from __future__ import annotations

import pytest
import torch

from worker.tlt.decoding.kv_cache import KVCache
from worker.tlt.decoding.pages import SCRATCH, PagePool
from worker.tlt.model.args import preset
from worker.tlt.rollout.reference import tiny_target


def test_grow_allocates_by_page_and_release_frees() -> None:
    pool = PagePool(n_pages=9, page_size=4, slots=3, pages_per_row=4)
    assert pool.free == pool.usable == 8
    assert pool.grow(0, 5) and pool.held[0] == 2 and pool.free == 6
    assert pool.grow(0, 8) and pool.held[0] == 2  # still within its pages
    assert pool.grow(0, 9) and pool.held[0] == 3
    assert pool.grow(1, 16) and pool.free == 1
    assert not pool.grow(2, 8) and pool.held[2] == 0 and pool.free == 1  # all or nothing
    assert SCRATCH not in pool.row_pages(0) + pool.row_pages(1)
    assert len(set(pool.row_pages(0)) | set(pool.row_pages(1))) == 7
    pool.check()
    pool.release(0)
    assert pool.free == 4 and pool.held[0] == 0 and (pool.table[0] == SCRATCH).all()
    pool.check()


def test_share_counts_full_pages_and_copies_the_partial_one() -> None:
    pool = PagePool(n_pages=12, page_size=4, slots=3, pages_per_row=4)
    assert pool.grow(0, 10)  # pages for columns 0..9: two full, one partial
    src = pool.row_pages(0)
    copies = pool.share(0, 1, 10)
    assert copies is not None and len(copies) == 1 and copies[0][0] == src[2]
    mine = pool.row_pages(1)
    assert mine[:2] == src[:2] and mine[2] == copies[0][1] != src[2]
    assert pool.refs[src[0]] == pool.refs[src[1]] == 2 and pool.refs[src[2]] == 1
    pool.check()
    assert pool.share(0, 2, 8) == []  # a page-aligned prompt: nothing to copy
    assert pool.refs[src[0]] == 3
    pool.release(0)  # shared pages stay while a sibling holds them
    assert pool.refs[src[0]] == 2 and src[0] not in pool._free and src[2] in pool._free
    pool.release(1)
    pool.release(2)
    assert pool.free == pool.usable
    pool.check()


def test_share_refuses_without_a_page_for_the_copy() -> None:
    pool = PagePool(n_pages=4, page_size=4, slots=2, pages_per_row=4)
    assert pool.grow(0, 10) and pool.free == 0
    assert pool.share(0, 1, 10) is None and pool.held[1] == 0
    pool.check()


def test_move_takes_the_pages_along_and_marks_rows_dirty() -> None:
    pool = PagePool(n_pages=8, page_size=2, slots=4, pages_per_row=3)
    pool.take_dirty()
    assert pool.grow(3, 5)
    pages = pool.row_pages(3)
    pool.move(3, 1)
    assert pool.row_pages(1) == pages and pool.held[3] == 0 and (pool.table[3] == SCRATCH).all()
    lo, rows = pool.take_dirty() or (None, None)
    assert lo == 1 and rows is not None and rows.shape[0] == 3 and rows[0].tolist() == pages
    assert pool.take_dirty() is None
    pool.check()


def _paged_like(rows: KVCache, page: int, pool: PagePool) -> KVCache:
    """A paged cache holding the same (row, column) contents as `rows`, its pages scattered by `pool`."""
    args_like = rows.k[0].shape
    t = rows.max_len
    paged = KVCache.allocate(preset("tiny-llama", n_layers=len(rows.k), n_kv_heads=args_like[1]), rows.slots, t,
                             "cpu", rows.k[0].dtype, page_size=page, n_pages=pool.n_pages)
    for r in range(rows.slots):
        assert pool.grow(r, t)
    paged.upload_table(*(pool.take_dirty() or (0, pool.table)))
    for src, dst in zip((*rows.k, *rows.v), (*paged.k, *paged.v), strict=True):
        for r in range(rows.slots):
            for j, p in enumerate(pool.row_pages(r)):
                dst[p] = src[r, :, j * page:(j + 1) * page]
    return paged


def _row_contents(c: KVCache, rows: int) -> list[torch.Tensor]:
    """Per tensor [rows, Hkv, T, D] as (row, column) addresses see it."""
    out = []
    for t in (*c.k, *c.v):
        if not c.paged:
            out.append(t[:rows].clone())
            continue
        pages = c.block_table[:rows].long()
        out.append(t[pages].transpose(1, 2).reshape(rows, t.shape[1], -1, t.shape[3]))
    return out


def test_compact_accepted_through_the_block_table_matches_rows() -> None:
    args = preset("tiny-llama", n_layers=2)
    rows = KVCache.allocate(args, slots=3, max_len=16, device="cpu", dtype=torch.float32)
    for i, t in enumerate((*rows.k, *rows.v)):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 1000 * i)
    pool = PagePool(n_pages=20, page_size=4, slots=3, pages_per_row=4)
    pool.grow(2, 4)  # a first row's page first: the others' pages are not in row order
    pool.release(2)
    paged = _paged_like(rows, 4, pool)
    base = torch.tensor([3, 5, 0])
    src = torch.tensor([[2, 5, 0], [1, 2, 3], [1, 4, 0]])  # across page boundaries (columns 5, 8 -> 4, 5)
    n_keep = torch.tensor([2, 0, 2])
    rows.compact_accepted(base, src, n_keep)
    paged.compact_accepted(base, src, n_keep)
    for a, b in zip(_row_contents(rows, 3), _row_contents(paged, 3), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("page", [4, 16])
def test_torch_forward_on_pages_equals_rows(page: int) -> None:
    torch.manual_seed(0)
    model = tiny_target()
    args = model.args
    t = 32
    rows = KVCache.allocate(args, slots=3, max_len=t, device="cpu", dtype=torch.float32)
    pool = PagePool(n_pages=40, page_size=page, slots=3, pages_per_row=t // page)
    pool.grow(1, 2 * page)  # scatter: later rows get lower pages
    pool.release(1)
    paged = _paged_like(rows, page, pool)
    ids = torch.randint(0, args.vocab_size, (2, 11))
    pos = torch.arange(11).expand(2, 11)
    cols = torch.arange(t)
    mask = (cols[None, None, :] <= pos[:, :, None])  # causal over columns 0..10
    outs = []
    for cache in (rows, paged):
        with torch.no_grad():  # prefill rows 1..2, then one decode token each at column 11
            a = model(ids, pos, cache, cache_rows=slice(1, 3), attn_mask=mask)
            nxt = torch.tensor([[7], [9]])
            p1 = torch.full((2, 1), 11)
            b = model(nxt, p1, cache, cache_rows=slice(1, 3), attn_mask=cols[None, None, :] <= p1[:, :, None])
        outs.append((a, b))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.allclose(outs[0][1], outs[1][1], atol=1e-6, rtol=0)
    for x, y in zip(_row_contents(rows, 3), _row_contents(paged, 3), strict=True):
        assert torch.equal(x[1:, :, :12], y[1:, :, :12])
