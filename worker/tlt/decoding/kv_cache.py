"""The engine's KV cache: allocated once, written by position, one row ("slot") per sequence, ragged lengths.

Layout per layer: K and V of shape [slots, Hkv, T, D]. The model writes a token's K/V at (row, column) given by the
engine (`Transformer.forward(..., write_idx=...)`) and attends through a boolean mask, so rows hold sequences of
different lengths (the lengths themselves live in the engine, on the device). Operations here never sync the host:

- `slots_for_budget(args, max_len, gb)`: how many sequences of `max_len` tokens fit in a memory budget;
- `move_rows(src, dst)`: copy whole rows (continuous batching keeps active sequences in rows 0..n-1);
- `compact_accepted(base, src_cols, n_keep)`: after a speculative step keep only the accepted tree nodes: per row,
  columns base+src_cols[i] (i < n_keep) move to base+1+i (rejected nodes are simply overwritten later).

Run the tests: `python -m pytest tests/engine/test_engine_kv_cache.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.tlt.model.args import ModelArgs


def bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    return 2 * args.n_layers * args.n_kv_heads * args.hd * torch.empty(0, dtype=dtype).element_size()


def slots_for_budget(args: ModelArgs, max_len: int, budget_gb: float, dtype: torch.dtype) -> int:
    """Rows of `max_len` columns that fit in `budget_gb` GiB (at least 1)."""
    return max(1, int(budget_gb * 2**30) // (bytes_per_token(args, dtype) * max_len))


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [slots, Hkv, T, D]
    v: list[torch.Tensor]  # per layer [slots, Hkv, T, D]

    @classmethod
    def allocate(cls, args: ModelArgs, slots: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype) -> KVCache:
        shape = (slots, args.n_kv_heads, max_len, args.hd)
        return cls(
            k=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)],
            v=[torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)],
        )

    @property
    def slots(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def max_len(self) -> int:
        return int(self.k[0].shape[2])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:  # src, dst [M] int64 row indices (disjoint)
        for t in (*self.k, *self.v):
            t.index_copy_(0, dst, t.index_select(0, src))

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
        t_len, hkv = self.max_len, self.k[0].shape[1]
        i = torch.arange(a, device=base.device)
        dst = base[:, None] + 1 + i[None, :]  # [B, A]
        valid = i[None, :] < n_keep[:, None]
        # invalid entries copy a column onto itself (identity); clamp keeps them in range (T has headroom)
        dst = dst.clamp_max(t_len - 1)
        src = torch.where(valid, base[:, None] + src_cols, dst)
        rows = torch.arange(b, device=base.device)
        heads = torch.arange(hkv, device=base.device)
        flat = (rows[:, None, None] * hkv + heads[None, :, None]) * t_len  # [B, Hkv, 1]
        src_f = (flat + src[:, None, :]).reshape(-1)
        dst_f = (flat + dst[:, None, :]).reshape(-1)
        for t in (*self.k, *self.v):
            view = t.view(-1, t.shape[-1])
            view.index_copy_(0, dst_f, view.index_select(0, src_f))
