"""`FeatureRing`: the last `context` target feature rows of every sequence the EAGLE proposer drafts for.

The engine's hidden hook (`Engine(hidden_hook=proposer.observe)`, called with the hidden state of every position
whose K/V entered the cache) feeds `observe(seq_ids, hidden)`, which writes each row into one preallocated device
ring [S, W, F] (one index_copy per call, no host sync). A row's first F columns are the drafter's feature: F = H
(EAGLE-1: the final-norm hidden) or 3H (EAGLE-3: the inputs of its three target layers, the engine built with
`EngineConfig.capture_layers`; the hook row's trailing final hidden is the trainer's, not read here).
`pack` lays out the host-side inputs of one draft (history tokens and ring indices); `gather` reads rows back.

Run the tests: `python -m pytest tests/drafter/test_drafter_proposer.py tests/drafter/test_drafter_chain_graph.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker.tlt.drafter.buffer import seq_runs, to_device_no_sync
from worker.tlt.spec.proposer import DraftContext

SeqId = tuple[int, int]  # (group / request, sample)


class FeatureRing:
    """Feature rows per sequence, a slot each (given on first sight, forgotten by `reset`); grows on demand."""

    def __init__(self, context: int, feature_dim: int, device: torch.device, slots: int = 64) -> None:
        self.context = context  # W: rows kept per sequence
        self.device = device
        self.rows = torch.zeros(slots, context, feature_dim, device=device)  # [S, W, F]
        self._slot: dict[SeqId, int] = {}
        self._count: list[int] = []  # rows ever written per slot

    @property
    def feature_dim(self) -> int:
        return self.rows.shape[2]

    def reset(self) -> None:
        self._slot.clear()
        self._count.clear()

    def observe(
        self,
        seq_ids: Sequence[SeqId],  # [N] sequence of each row
        hidden: torch.Tensor,  # [N, >= F] target feature of each row (the first F columns), in position order
    ) -> None:
        """Remember the last `context` features of each sequence (no host sync)."""
        n = len(seq_ids)
        if n == 0:
            return
        w = self.context
        runs = seq_runs(seq_ids)  # Python per run, numpy per row
        slots = np.empty(len(runs), dtype=np.int64)
        starts = np.empty(len(runs), dtype=np.int64)
        for j, (sid, size) in enumerate(runs):
            slot = self._slot.get(sid)
            if slot is None:
                slot = self._slot[sid] = len(self._count)
                self._count.append(0)
            slots[j], starts[j] = slot, self._count[slot]
            self._count[slot] += size
        sizes = np.array([size for _, size in runs], dtype=np.int64)
        within = np.arange(n) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # position of each row inside its run
        flat = np.repeat(slots * w, sizes) + (np.repeat(starts, sizes) + within) % w
        need = len(self._count)
        if need > self.rows.shape[0]:
            grown = torch.zeros(max(need, 2 * self.rows.shape[0], 64), w, self.feature_dim, device=self.device)
            grown[: self.rows.shape[0]] = self.rows
            self.rows = grown
        f = self.feature_dim
        src = hidden[:, :f].detach()
        # A sequence bringing more than `context` rows in one call (a long prefill) maps several rows to one ring
        # cell; CUDA's index_copy_ lets any of them win, so only the last writer of each cell is written.
        cells, last_rev = np.unique(flat[::-1], return_index=True)
        if len(cells) < n:
            keep = np.sort(n - 1 - last_rev)
            flat, src = flat[keep], src[to_device_no_sync(keep, src.device)]
        self.rows.view(-1, f).index_copy_(0, to_device_no_sync(flat, self.device), src.to(self.device, torch.float32))

    def pack(self, ctx: DraftContext, rows: int) -> np.ndarray:
        """Host-side inputs of `rows` >= B rows (padding rows zero), one int64 array [rows, 2W + 2]:
        [0, W) the last W history tokens (right-aligned; the last is the root), [W, 2W) feature-ring index of each
        entry, 2W valid entries m (features known), 2W + 1 history length."""
        w = self.context
        bsz = ctx.batch_size
        arr = np.zeros((rows, 2 * w + 2), dtype=np.int64)
        slots = np.zeros(bsz, dtype=np.int64)
        cnts = np.zeros(bsz, dtype=np.int64)
        for b in range(bsz):
            h = ctx.histories[b]
            tail = h[-w:]
            arr[b, w - len(tail): w] = tail
            slot = self._slot.get((ctx.group_ids[b], ctx.sample_ids[b]))
            cnt = self._count[slot] if slot is not None else 0
            slots[b], cnts[b] = slot or 0, cnt
            arr[b, 2 * w] = min(cnt, w, len(h) - 1)
            arr[b, 2 * w + 1] = len(h)
        col = np.arange(w)
        idx = slots[:, None] * w + (cnts[:, None] - w + col[None, :]) % w
        arr[:bsz, w: 2 * w] = np.where(col[None, :] >= w - arr[:bsz, 2 * w, None], idx, 0)
        return arr

    def gather(self, index: torch.Tensor) -> torch.Tensor:  # [B, W] flat ring indices (pack's [W, 2W)) -> [B, W, F]
        return self.rows.view(-1, self.feature_dim)[index]
