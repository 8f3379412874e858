"""The engine's KV cache: allocated once, written by (row, column), ragged lengths, one layout with block tables.

Layout per layer: K and V pools of shape [n_pages, Hkv, P, D] and one block table [slots, pages_per_row] int32 on
the device: a row's ("slot's") column c lives at page block_table[row, c // P], offset c % P. The model writes a
token's K/V at (row, column) given by the engine (`Transformer.forward(..., write_idx=...)`) and attends through a
boolean mask over the row's columns 0..Tk-1, so rows hold sequences of different lengths (the lengths live in the
engine, on the device). Two layouts, one code path:

- rows (`page_size=None`): P = max_len, one page per row and the identity table: every sequence owns max_len columns
  (the torch path reads a row as a view, no gather); `move_rows` copies the rows' K/V;
- paged (`page_size=P`, `n_pages`): pages handed out as sequences grow by the host's decoding/pages.PagePool, whose
  table rows are uploaded here (`upload_table`); page 0 is scratch (unassigned entries name it); `move_rows` moves
  table rows (no K/V copied); GRPO siblings share their prompt's full pages (`copy_pages` makes the partial one).

Operations here never sync the host:
- `slots_for_budget(args, max_len, gb)` / `pages_for_budget(args, page, gb)`: what fits in a memory budget;
- `move_rows(src, dst)`: continuous batching keeps active sequences in rows 0..n-1;
- `compact_accepted(base, src_cols, n_keep)`: after a speculative step keep only the accepted tree nodes: per row,
  columns base+src_cols[i] (i < n_keep) move to base+1+i (rejected nodes are simply overwritten later).

Run the tests: `python -m pytest tests/engine/test_engine_kv_cache.py tests/engine/test_engine_pages.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from worker.tlt.model.args import ModelArgs


def bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    return 2 * args.n_layers * args.n_kv_heads * args.hd * torch.empty(0, dtype=dtype).element_size()


def slots_for_budget(args: ModelArgs, max_len: int, budget_gb: float, dtype: torch.dtype) -> int:
    """Rows of `max_len` columns that fit in `budget_gb` GiB (at least 1)."""
    return max(1, int(budget_gb * 2**30) // (bytes_per_token(args, dtype) * max_len))


def pages_for_budget(args: ModelArgs, page_size: int, budget_gb: float, dtype: torch.dtype) -> int:
    """Pages of `page_size` columns that fit in `budget_gb` GiB (at least 2: one is scratch)."""
    return max(2, int(budget_gb * 2**30) // (bytes_per_token(args, dtype) * page_size))


def identity_table(slots: int, device: torch.device | str) -> torch.Tensor:
    return torch.arange(slots, dtype=torch.int32, device=device)[:, None]


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [n_pages, Hkv, P, D]
    v: list[torch.Tensor]  # per layer [n_pages, Hkv, P, D]
    block_table: torch.Tensor = field(default=None)  # type: ignore[assignment]  # [slots, pages_per_row] int32
    paged: bool = False  # False: the row layout (P = max_len, identity table)

    def __post_init__(self) -> None:
        if self.block_table is None:  # the row layout of k / v as given
            self.block_table = identity_table(self.k[0].shape[0], self.k[0].device)

    @classmethod
    def allocate(cls, args: ModelArgs, slots: int, max_len: int, device: torch.device | str, dtype: torch.dtype,
                 *, page_size: int | None = None, n_pages: int | None = None) -> KVCache:
        """Rows of max_len columns (page_size None), or a pool of n_pages pages of page_size columns behind a table
        of slots rows of ceil(max_len / page_size) pages (every entry the scratch page 0)."""
        if page_size is None or page_size >= max_len:
            if page_size is not None:  # one page per row: the row layout
                page_size = max_len
            shape = (slots, args.n_kv_heads, max_len, args.hd)
            table = identity_table(slots, device)
            paged = False
        else:
            if n_pages is None or n_pages < 2:
                raise ValueError("a paged cache needs n_pages >= 2 (page 0 is scratch)")
            shape = (n_pages, args.n_kv_heads, page_size, args.hd)
            table = torch.zeros((slots, -(-max_len // page_size)), dtype=torch.int32, device=device)
            paged = True
        return cls(
            k=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)],
            v=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)],
            block_table=table, paged=paged,
        )

    @property
    def slots(self) -> int:
        return int(self.block_table.shape[0])

    @property
    def page_size(self) -> int:
        return int(self.k[0].shape[2])

    @property
    def n_pages(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def pages_per_row(self) -> int:
        return int(self.block_table.shape[1])

    @property
    def max_len(self) -> int:  # columns a row can address
        return self.pages_per_row * self.page_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def upload_table(self, row0: int, rows: np.ndarray) -> None:
        """Block-table rows row0.. from the host, stream-ordered (steps already launched read the old entries) and on
        CUDA without a host sync: from a pinned snapshot, which the caching host allocator keeps until the copy ran."""
        src = torch.from_numpy(np.ascontiguousarray(rows))
        dst = self.block_table[row0: row0 + rows.shape[0]]
        if dst.is_cuda:
            dst.copy_(src.pin_memory(), non_blocking=True)
        else:
            dst.copy_(src)

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:  # src, dst [M] int64 row indices (disjoint)
        if self.paged:
            self.block_table.index_copy_(0, dst, self.block_table.index_select(0, src))
            return
        for t in (*self.k, *self.v):
            t.index_copy_(0, dst, t.index_select(0, src))

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:  # [M] int64 page indices (disjoint)
        for t in (*self.k, *self.v):
            t.index_copy_(0, dst, t.index_select(0, src))

    def flat_index(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Rows [B, 1] and columns [B, A] -> index [B, Hkv, A] into a layer tensor viewed as [n_pages * Hkv * P, D]."""
        p, hkv = self.page_size, self.k[0].shape[1]
        page = self.block_table[rows, cols // p].to(torch.int64)  # [B, A]
        heads = torch.arange(hkv, device=cols.device)
        return (page[:, None, :] * hkv + heads[None, :, None]) * p + (cols % p)[:, None, :]

    def compact_accepted(
        self,
        base: torch.Tensor,  # [B] int64 column of each row's root (rows 0..B-1)
        src_cols: torch.Tensor,  # [B, A] int64 accepted node index (>= 1) relative to base, in path order
        n_keep: torch.Tensor,  # [B] int64 how many of src_cols are valid
    ) -> None:
        """Per row b: column base+src_cols[b, i] -> base+1+i for i < n_keep[b] (reads all before writing)."""
        b, a = src_cols.shape
        if a == 0:
            return
        i = torch.arange(a, device=base.device)
        dst = base[:, None] + 1 + i[None, :]  # [B, A]
        valid = i[None, :] < n_keep[:, None]
        # invalid entries copy a column onto itself (identity); clamp keeps them in range (T has headroom)
        dst = dst.clamp_max(self.max_len - 1)
        src = torch.where(valid, base[:, None] + src_cols, dst)
        rows = torch.arange(b, device=base.device)[:, None]
        src_f = self.flat_index(rows, src).reshape(-1)
        dst_f = self.flat_index(rows, dst).reshape(-1)
        for t in (*self.k, *self.v):
            view = t.view(-1, t.shape[-1])
            view.index_copy_(0, dst_f, view.index_select(0, src_f))
