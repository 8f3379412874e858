"""The host side of the paged KV cache: which pages each cache row holds, which pages are free, and how many rows
hold each page. The device side (the page pools and the block table the kernels read) is decoding/kv_cache.py's.

A row's columns c live at (table[row][c // P], c % P). Pages are handed out as a sequence grows and given back when
it leaves; GRPO siblings share their prompt's full pages (a reference count per page) and get a private copy of the
last, partly filled one, since the next token's K/V is written into it (copy on write, done at admission: nothing
ever writes into a page two rows hold). Page 0 is the scratch page: every unassigned table entry points at it, so the
writes of padding rows and of columns past a row's pages land there and are never read as anyone's context.

    pool = PagePool(n_pages=1024, page_size=64, slots=128, pages_per_row=64)
    pool.grow(row, n_cols)            # False (nothing taken) when the free pages do not cover it
    copies = pool.share(src, dst, n_cols)   # dst holds src's first n_cols: shared full pages + copied partial page
    pool.release(row)                 # its pages back to the free list once no row holds them
    pool.move(src, dst)               # continuous batching: the row's pages follow it
    rows, table = pool.take_dirty()   # the table rows changed since the last call, for one upload

Run the tests: `python -m pytest tests/engine/test_engine_pages.py -q`.
"""

from __future__ import annotations

import numpy as np

SCRATCH = 0  # the page every unassigned table entry names


class PagePool:
    def __init__(self, n_pages: int, page_size: int, slots: int, pages_per_row: int) -> None:
        if n_pages < 2 or page_size < 1:
            raise ValueError(f"a page pool needs >= 2 pages (one is scratch) of >= 1 column: {n_pages} x {page_size}")
        self.n_pages, self.page_size, self.slots, self.pages_per_row = n_pages, page_size, slots, pages_per_row
        self.refs = np.zeros(n_pages, dtype=np.int64)
        self.refs[SCRATCH] = 1  # never handed out
        self._free = list(range(n_pages - 1, SCRATCH, -1))  # a stack: pages freed last are reused first
        self.table = np.full((slots, pages_per_row), SCRATCH, dtype=np.int32)
        self.held = np.zeros(slots, dtype=np.int64)  # pages assigned per row (a prefix of its table row)
        self._dirty_lo, self._dirty_hi = slots, 0  # rows [lo, hi) changed since take_dirty

    # ------------------------------------------------------------------------------------------------ queries
    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def usable(self) -> int:
        return self.n_pages - 1  # the scratch page is never a row's

    def pages_for(self, n_cols: int) -> int:
        return -(-n_cols // self.page_size)

    def cols_held(self, row: int) -> int:
        return int(self.held[row]) * self.page_size

    def row_pages(self, row: int) -> list[int]:
        return self.table[row, : self.held[row]].tolist()

    # ------------------------------------------------------------------------------------------------ changes
    def grow(self, row: int, n_cols: int) -> bool:
        """Give `row` pages up to n_cols columns -> False (and nothing taken) when too few pages are free."""
        need = min(self.pages_for(n_cols), self.pages_per_row) - int(self.held[row])
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        h = int(self.held[row])
        for j in range(h, h + need):
            p = self._free.pop()
            self.refs[p] = 1
            self.table[row, j] = p
        self.held[row] = h + need
        self._touch(row)
        return True

    def share(self, src: int, dst: int, n_cols: int) -> list[tuple[int, int]] | None:
        """`dst` (holding nothing) takes src's first n_cols columns: the full pages shared, the partial last page a
        fresh copy -> the (src page, dst page) copies the device must make; None (nothing taken) when no page is
        free for the copy."""
        assert self.held[dst] == 0, "share into an empty row"
        full, partial = divmod(n_cols, self.page_size)
        if partial and not self._free:
            return None
        pages = self.table[src, :full]
        self.refs[pages] += 1
        self.table[dst, :full] = pages
        copies = []
        if partial:
            p = self._free.pop()
            self.refs[p] = 1
            self.table[dst, full] = p
            copies.append((int(self.table[src, full]), p))
        self.held[dst] = full + (1 if partial else 0)
        self._touch(dst)
        return copies

    def release(self, row: int) -> None:
        """Give back every page of `row` (a page returns to the free list when no row holds it any more)."""
        h = int(self.held[row])
        for p in self.table[row, :h].tolist():
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)
        self.table[row, :h] = SCRATCH
        self.held[row] = 0
        self._touch(row)

    def move(self, src: int, dst: int) -> None:
        """`src`'s pages become `dst`'s (dst holds nothing; src ends empty)."""
        assert self.held[dst] == 0, "move into an empty row"
        self.table[dst] = self.table[src]
        self.held[dst] = self.held[src]
        self.table[src] = SCRATCH
        self.held[src] = 0
        self._touch(src)
        self._touch(dst)

    def _touch(self, row: int) -> None:
        self._dirty_lo, self._dirty_hi = min(self._dirty_lo, row), max(self._dirty_hi, row + 1)

    def take_dirty(self) -> tuple[int, np.ndarray] | None:
        """(first row, table rows [k, pages_per_row]) changed since the last call, or None."""
        lo, hi = self._dirty_lo, self._dirty_hi
        if hi <= lo:
            return None
        self._dirty_lo, self._dirty_hi = self.slots, 0
        return lo, self.table[lo:hi]

    def check(self) -> None:
        """Invariants (tests): every page's count equals the rows naming it; free pages are named by none."""
        counts = np.zeros(self.n_pages, dtype=np.int64)
        for r in range(self.slots):
            np.add.at(counts, self.table[r, : self.held[r]], 1)
            assert (self.table[r, self.held[r]:] == SCRATCH).all()
        counts[SCRATCH] = 1
        assert (counts == self.refs).all(), "reference counts disagree with the table"
        assert sorted(self._free) == [p for p in range(self.n_pages) if counts[p] == 0]
