"""`FeatureRing`: the last `context` target feature rows of every sequence the EAGLE proposer drafts for.

The engine's hidden hook (`Engine(hidden_hook=proposer.observe)`, called with the hidden state of every position
whose K/V entered the cache) feeds `observe(seq_ids, hidden)`, which writes each row into one preallocated device
ring [S, W, F] (one index_copy per call, no host sync). A row's first F columns are the drafter's feature: F = H
(EAGLE-1: the final-norm hidden) or 3H (EAGLE-3: the inputs of its three target layers, the engine built with
`EngineConfig.capture_layers`; the hook row's trailing final hidden is the trainer's, not read here).
`pack` lays out the host-side inputs of one draft (history tokens and ring indices); `gather` reads rows back.
Both run between a speculative step's host read and its next replay, while the GPU idles, so their host work is
kept to Python per sequence run plus a handful of numpy calls: `observe` writes ring cells as ranges (one upload
through a reused buffer.HostStage), `pack` keeps each sequence's last W history tokens ringed on the host and
copies only the tokens added since its last call (the histories only grow), and can write straight into a graph's
staging buffer with the ring indices leading (`lead=True`: a contiguous gather index).

Run the tests: `python -m pytest tests/drafter/test_drafter_proposer.py tests/drafter/test_drafter_chain_graph.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker.tlt.decoding.uploads import HostStage, runs_ident, seq_runs, to_device_no_sync
from worker.tlt.speculative.proposers.protocol import DraftContext

SeqId = tuple[int, int]  # (group / request, sample)


class FeatureRing:
    """Feature rows per sequence, a slot each (given on first sight, forgotten by `reset`); grows on demand. Between
    resets a sequence's history only grows (the engine's token lists): `pack` keeps each slot's last W history tokens
    on the host, ringed like its features, and writes only the tokens added since its last call.

    Host cost per call is a handful of numpy calls plus Python per sequence run (not per row): at the sizes of a
    speculative step (8 sequences, 1-7 rows each) a numpy call costs as much as ~20 Python-level list operations."""

    def __init__(self, context: int, feature_dim: int, device: torch.device, slots: int = 64) -> None:
        self.context = context  # W: rows kept per sequence
        self.device = device
        self.rows = torch.zeros(slots, context, feature_dim, device=device)  # [S, W, F]
        self.rows2d = self.rows.view(-1, feature_dim)  # [S*W, F] the same memory (a view made once)
        self._slot: dict[SeqId, int] = {}
        self._count: list[int] = []  # feature rows ever written per slot
        self._tok = np.zeros((slots, context), dtype=np.int64)  # [S, W] history token i of slot s at [s, i % W]
        self._tok_len: list[int] = []  # history tokens written to _tok per slot
        self._col = np.arange(context) - context  # [W] column c of a window ends W - c positions before its end
        self._rot = (np.arange(context)[:, None] + np.arange(context)[None, :]) % context  # [W, W] (e + c) mod W
        self._stage = HostStage(device)  # observe's ring cells, uploaded every call
        self._observed: tuple[object, list[int]] | None = None  # last observe's sequences (distinct), slots
        self._packed: tuple[DraftContext, list[int], np.ndarray] | None = None  # last pack's ctx, slots, slots*W x2
        self._out: tuple[tuple[int, int, int, bool], np.ndarray, tuple[np.ndarray, ...]] | None = None  # pack's views

    @property
    def feature_dim(self) -> int:
        return self.rows.shape[2]

    def reset(self) -> None:
        self._slot.clear()
        self._count.clear()
        self._tok_len.clear()
        self._observed = self._packed = None

    def _slot_of(self, sid: SeqId) -> int:
        slot = self._slot.get(sid)
        if slot is None:
            slot = self._slot[sid] = len(self._count)
            self._count.append(0)
            self._tok_len.append(0)
            if slot == len(self._tok):  # the host token ring grows here, the device feature ring in observe
                self._tok = np.concatenate([self._tok, np.zeros_like(self._tok)])
        return slot

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
        runs = seq_runs(seq_ids)
        ident = runs_ident(seq_ids, runs)
        if self._observed is not None and self._observed[0] == ident:  # a speculative step: the same sequences
            slots = self._observed[1]
            distinct = True
        else:
            slots = [self._slot_of(sid) for sid, _ in runs]
            distinct = len(set(slots)) == len(slots)
            self._observed = (ident, slots) if distinct else None
        # ring cell of each row: a run continues its sequence's ring where the last one stopped (ranges, not rows)
        count = self._count
        cells: list[int] = []
        wide = not distinct and n > w  # some sequence brings more than W rows: cells repeat
        for slot, (_, size) in zip(slots, runs, strict=True):
            start = count[slot]
            count[slot] = start + size
            base, a = slot * w, start % w
            if a + size <= w:
                cells += range(base + a, base + a + size)
            elif size <= w:
                cells += range(base + a, base + w)
                cells += range(base, base + a + size - w)
            else:
                wide = True
                cells += [base + (start + i) % w for i in range(size)]
        self._grow(len(self._count))
        f = self.feature_dim
        src = hidden if hidden.shape[1] == f else hidden[:, :f]
        src = src.detach() if src.requires_grad else src
        # A sequence bringing more than `context` rows in one call (a long prefill) maps several rows to one ring
        # cell; CUDA's index_copy_ lets any of them win, so only the last writer of each cell is written.
        if wide:
            flat = np.array(cells, dtype=np.int64)
            uniq, last_rev = np.unique(flat[::-1], return_index=True)
            if len(uniq) < n:
                keep = np.sort(n - 1 - last_rev)
                cells, src = flat[keep].tolist(), src[to_device_no_sync(keep, src.device)]
        if src.dtype != torch.float32 or src.device != self.device:
            src = src.to(self.device, torch.float32)
        self.rows2d.index_copy_(0, self._stage.put(cells)[0], src)

    def slots(self, ctx: DraftContext) -> list[int]:
        """The ring slot of each of the context's sequences (given on first sight)."""
        return self._pack_slots(ctx)[0]

    def counts(self, ctx: DraftContext) -> list[int]:
        """Feature rows ever written for each of the context's sequences."""
        return [self._count[s] for s in self.slots(ctx)]

    def absorb(self, slots: list[int], counts: list[int], source: torch.Tensor) -> None:
        """Take features written elsewhere: source [B, S, F] holds feature i of slots[b]'s sequence at [b, i mod S]
        for the last min(counts[b], S) indices (a DraftWindow's rings); counts[b] is how many that sequence has now.
        The rows this ring lacks are copied (one index_copy) and its counts follow."""
        w, span = self.context, source.shape[1]
        src: list[int] = []
        dst: list[int] = []
        for b, (slot, c) in enumerate(zip(slots, counts, strict=True)):
            old = self._count[slot]
            if c != old:
                idx = range(max(old, c - w), c)
                src += [b * span + i % span for i in idx]
                dst += [slot * w + i % w for i in idx]
                self._count[slot] = c
        if src:
            self._grow(len(self._count))
            rows = source.reshape(-1, source.shape[2]).index_select(0, to_device_no_sync(np.array(src), self.device))
            self.rows2d.index_copy_(0, to_device_no_sync(np.array(dst), self.device), rows.to(self.rows.dtype))

    def _grow(self, need: int) -> None:  # device rows for `need` slots
        if need > self.rows.shape[0]:
            w = self.context
            grown = torch.zeros(max(need, 2 * self.rows.shape[0], 64), w, self.feature_dim, device=self.device)
            grown[: self.rows.shape[0]] = self.rows
            self.rows, self.rows2d = grown, grown.view(-1, self.feature_dim)

    def _pack_slots(self, ctx: DraftContext) -> tuple[list[int], np.ndarray]:  # slots [B], slots * W [2B, 1]
        if self._packed is None or self._packed[0] is not ctx:  # the engine reuses one ctx while its rows stay
            slots = [self._slot_of(sid) for sid in zip(ctx.group_ids, ctx.sample_ids, strict=True)]
            self._packed = (ctx, slots, np.array(slots + slots, dtype=np.int64)[:, None] * self.context)
        return self._packed[1], self._packed[2]

    def _pack_views(self, out: np.ndarray | None, rows: int, bsz: int, lead: bool) -> tuple[np.ndarray, ...]:
        """pack's array and its regions (the whole flat buffer, [rows, 2W+2], tokens, ring indices, m, length),
        zero-filled; kept for the next call into the same `out` with the same shape, which rewrites every region
        but the zeros (padding rows, [W, 2W) with lead)."""
        w = self.context
        key = (id(out), rows, bsz, lead)
        if out is not None and self._out is not None and self._out[0] == key and self._out[1] is out:
            return self._out[2]
        size = rows * w * lead + rows * (2 * w + 2)
        buf = np.zeros(size, dtype=np.int64) if out is None else out[:size]
        buf[:] = 0
        arr = buf[rows * w * lead:].reshape(rows, 2 * w + 2)
        ring = buf[: bsz * w].reshape(bsz, w) if lead else arr[:bsz, w: 2 * w]
        views = (buf, arr, arr[:bsz, :w], ring, arr[:bsz, 2 * w], arr[:bsz, 2 * w + 1])
        if out is not None:
            self._out = (key, out, views)
        return views

    def pack(self, ctx: DraftContext, rows: int, lead: bool = False, out: np.ndarray | None = None) -> np.ndarray:
        """Host-side inputs of `rows` >= B rows (padding rows zero), one int64 array [rows, 2W + 2]:
        [0, W) the last W history tokens (right-aligned; the last is the root), [W, 2W) feature-ring index of each
        entry, 2W valid entries m (features known), 2W + 1 history length. lead: a flat array [rows*W + rows*(2W+2)]
        instead, the ring indices [rows, W] first (contiguous: a gather index as uploaded) and that array after them,
        its [W, 2W) left zero.
        out: the array to write (of that size; e.g. HostStage.host_for: pinned memory, or a graph's own buffer)."""
        w = self.context
        bsz = ctx.batch_size
        slots, base = self._pack_slots(ctx)
        tok, tok_len, count = self._tok, self._tok_len, self._count
        lens, cnts, ms, ends = [], [], [], []
        new_cells: list[int] = []
        new_toks: list[int] = []
        for h, slot in zip(ctx.histories, slots, strict=True):
            n, k = len(h), tok_len[slot]
            if n != k:  # the tokens added since the last pack (a shorter history: another sequence under this id)
                lo = max(k if k < n else 0, n - w)
                a, m, first = lo % w, n - lo, slot * w
                new_toks += h[lo:n]
                if a + m <= w:
                    new_cells += range(first + a, first + a + m)
                else:
                    new_cells += range(first + a, first + w)
                    new_cells += range(first, first + a + m - w)
                tok_len[slot] = n
            c = count[slot]
            lens.append(n)
            cnts.append(c)
            ms.append(min(c, w, n - 1))
            ends.append(n % w)
        ends += [c % w for c in cnts]
        if new_cells:
            np.put(tok, new_cells, new_toks)
        # ring cell of every column: window column c of a row whose ring ends at e is cell (e - W + c) mod W
        cell = self._rot[ends]  # [2B, W] history tokens, then features
        cell += base
        buf, arr, tok_v, ring_v, m_v, len_v = self._pack_views(out, rows, bsz, lead)
        if min(lens) >= w:
            np.take(tok, cell[:bsz], out=tok_v, mode="wrap")  # (every index is in range; "wrap" writes in place)
        else:
            tok_v[:] = np.where(np.array(lens, dtype=np.int64)[:, None] + self._col >= 0, np.take(tok, cell[:bsz]), 0)
        ring_v[:] = cell[bsz:] if min(ms) == w else np.where(self._col >= -np.array(ms, dtype=np.int64)[:, None],
                                                              cell[bsz:], 0)
        m_v[:] = ms
        len_v[:] = lens
        return buf if lead else arr

    def gather(self, index: torch.Tensor) -> torch.Tensor:  # [B, W] flat ring indices (pack's [W, 2W)) -> [B, W, F]
        return self.rows2d[index]
