"""Bounded buffer of (token id, target hidden state) rows from the last two RL steps' rollouts: the spot trainer's data.

The engine fills it through `capture(seq_ids, token_ids, hidden)` from the hidden states its forwards compute anyway
(no extra target forward). Contract, per sequence: rows arrive in position order, each position once; row i pairs
the token *fed* at a position with the target hidden state computed there (`hidden[i]` is what predicts the next
token). `hidden` is the drafter's training row: the final-norm hidden [H] for EAGLE-1; concat(the three EAGLE-3
features, final-norm hidden) [4H] for EAGLE-3 (the final hidden gives the soft-CE target through the frozen head).

Storage is one ring allocated once (GPU or pinned host memory) sized from a byte budget; `begin_step(step)` drops
rows of steps older than the previous one, and when the ring is full the oldest rows are overwritten first (so the
oldest step goes first). `capture` only writes by index: with the ring on the GPU no host sync, safe inside the decode loop (a host ring
costs one blocking device -> host copy per call).
`sample(batch, window, generator)` returns training windows: up to `window` consecutive rows of one sequence each,
as fixed-shape [B, W] tensors drawn on the buffer's device with a generator of that device: no host sync once the
window index is built (it is rebuilt after captures: one host read per rebuild, of the number of window starts).
`state_dict()` / `load_state_dict()` carry the live rows and the ring position through a checkpoint (exact resume).
`EngineCapture` (the engine's hook) defers its writes (`capture(..., defer=True)`): a speculative step's ~16 rows are
kept and written with the next few thousand in one go, before anything reads the ring (its tensors are properties
that flush), so the trainer's capture costs the GPU-idle host path no device work per step.
Per-step uploads go through decoding/uploads.py (`HostStage`; `SeqIds` carries the hook's runs,
so that consumers skip regrouping the rows).

Run the tests: `python -m pytest tests/drafter/test_drafter_buffer.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker.tlt.decoding.uploads import HostStage, runs_ident, seq_runs, to_device_no_sync


@dataclass(frozen=True)
class Batch:
    """Training windows, left-aligned; rows past `lengths[b]` are padding."""

    tokens: torch.Tensor  # [B, W] int64
    hidden: torch.Tensor  # [B, W, F]
    lengths: torch.Tensor  # [B] int64 valid rows per window (>= 2)


@dataclass(frozen=True)
class _WindowIndex:
    rows: torch.Tensor  # [M] ring slots of the live rows sorted by (step, sequence, write order)
    ends: torch.Tensor  # [M] sorted position of the last row of each row's sequence
    starts_cum: torch.Tensor  # [M] int64 inclusive count of window starts (rows with a successor) up to each row
    n_starts: int  # window starts in all (host int: read once per rebuild)


class HiddenStateBuffer:
    def __init__(
        self,
        width: int,  # F: floats per row
        budget_bytes: int,  # total memory for the ring (tokens + hidden + bookkeeping)
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,  # storage dtype of the hidden states
        pin_memory: bool = False,  # host ring in pinned memory (for async device -> host copies)
        keep_steps: int = 2,  # RL steps kept (TLT: this and the previous one)
    ) -> None:
        row_bytes = width * torch.empty(0, dtype=dtype).element_size() + 3 * 8
        self.capacity = int(budget_bytes // row_bytes)
        if self.capacity < 2:
            raise ValueError(f"buffer budget {budget_bytes} B holds fewer than 2 rows of {row_bytes} B")
        self.width, self.keep_steps = width, keep_steps
        dev = torch.device(device)
        pin = pin_memory and dev.type == "cpu" and torch.cuda.is_available()

        def alloc(*shape: int, dt: torch.dtype, fill: int = 0) -> torch.Tensor:
            t = torch.full(shape, fill, dtype=dt, device=dev)
            return t.pin_memory() if pin else t

        self._hidden = alloc(self.capacity, width, dt=dtype)  # [C, F]
        self._tokens = alloc(self.capacity, dt=torch.int64)  # [C]
        self._seq = alloc(self.capacity, dt=torch.int64, fill=-1)  # [C] sequence id
        self._step = alloc(self.capacity, dt=torch.int64, fill=-1)  # [C] RL step; -1 = empty
        self.device = dev
        self._stage = HostStage(dev)  # host ids + ring index -> one upload per write
        # deferred captures (seq ids, tokens, hidden), written together before anything reads the ring
        self._pending: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
        self._pending_rows = 0
        self.defer_rows = 4096  # pending rows that force a write
        self.current_step = 0
        self.written = 0  # rows ever written (the ring position is written % capacity)
        self._index: _WindowIndex | None = None  # rebuilt after captures and step changes

    # the ring (every read of it first writes the deferred captures)
    @property
    def hidden(self) -> torch.Tensor:  # [C, F]
        self.flush()
        return self._hidden

    @property
    def tokens(self) -> torch.Tensor:  # [C] int64
        self.flush()
        return self._tokens

    @property
    def seq(self) -> torch.Tensor:  # [C] int64 sequence id
        self.flush()
        return self._seq

    @property
    def step(self) -> torch.Tensor:  # [C] int64 RL step; -1 = empty
        self.flush()
        return self._step

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.tokens, self.seq, self.step))

    def begin_step(self, step: int) -> None:
        """Rows captured from now on belong to `step`; rows older than `keep_steps` steps are dropped."""
        self.flush()  # deferred rows belong to the step they were captured in
        self.current_step = step
        stale = (self.step >= 0) & (self.step <= step - self.keep_steps)
        self.step.masked_fill_(stale, -1)
        self._index = None

    def capture(
        self,
        seq_ids: torch.Tensor | list[int],  # [N] int64 sequence id of each row (unique within the step)
        token_ids: torch.Tensor,  # [N] int64 token fed at the row's position
        hidden: torch.Tensor,  # [N, F] target hidden state computed at that position
        defer: bool = False,  # the caller hands the tensors over (never writes them again): write them later
    ) -> None:
        """Write the rows at the ring position. Ids given as a host list travel with the ring index in one upload;
        as a tensor, the index is computed on the device. defer (host ids): keep the rows and write every deferred
        capture at once when `defer_rows` are pending or before the ring is read (any of its tensors, `sample`,
        `len`, a checkpoint, `begin_step`): a speculative step's ~16 rows then cost no device work of their own."""
        n = int(token_ids.shape[0])
        if n == 0:
            return
        if hidden.shape != (n, self.width):
            raise ValueError(f"hidden has shape {tuple(hidden.shape)}, expected ({n}, {self.width})")
        if defer and isinstance(seq_ids, list):
            self._pending.append((seq_ids, token_ids, hidden))
            self._pending_rows += n
            if self._pending_rows >= self.defer_rows:
                self.flush()
            return
        self.flush()
        self._write(seq_ids, token_ids, hidden)

    def flush(self) -> None:
        """Write the deferred captures (in capture order)."""
        if not self._pending:
            return
        pend, self._pending, self._pending_rows = self._pending, [], 0
        if len(pend) == 1:
            self._write(*pend[0])
            return
        ids = [i for p in pend for i in p[0]]
        self._write(ids, torch.cat([p[1] for p in pend]), torch.cat([p[2] for p in pend]))

    def _write(self, seq_ids: torch.Tensor | list[int], token_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        n = int(token_ids.shape[0])
        if n > self.capacity:  # keep the newest rows only
            seq_ids, token_ids, hidden = seq_ids[-self.capacity:], token_ids[-self.capacity:], hidden[-self.capacity:]
            self.written += n - self.capacity
            n = self.capacity
        start = self.written % self.capacity
        if isinstance(seq_ids, list):
            end = start + n
            ring = [*range(start, end)] if end <= self.capacity else [*range(start, self.capacity),
                                                                       *range(end - self.capacity)]
            idx, seq = self._stage.put(ring, seq_ids)
        else:
            idx = (torch.arange(n, device=self.device) + start) % self.capacity
            seq = seq_ids.to(self.device, torch.int64)
        # device -> host copies are blocking (a CPU op reads them next); keep the ring on the GPU for the hot path
        self._hidden.index_copy_(0, idx, hidden.detach().to(self.device, self._hidden.dtype))
        self._tokens.index_copy_(0, idx, token_ids.to(self.device, torch.int64))
        self._seq.index_copy_(0, idx, seq)
        self._step.index_fill_(0, idx, self.current_step)
        self.written += n
        self._index = None

    def __len__(self) -> int:
        return int((self.step >= 0).sum())

    def steps_held(self) -> list[int]:
        return sorted(int(s) for s in torch.unique(self.step[self.step >= 0]).tolist())

    def _build_index(self) -> _WindowIndex:
        """Live rows sorted by (step, sequence, write order), each row's segment end, and the running count of window
        starts (a row with a successor in its sequence)."""
        c = self.capacity
        # write order of each ring slot: slots at/after the ring position were written one lap earlier
        pos = self.written % c
        slot = torch.arange(c, device=self.device)
        order = torch.where(slot < pos, slot + c, slot)
        valid = self.step >= 0
        rows = slot[valid]  # data-dependent size: one host sync per rebuild, never per sample
        key_order, key_seq, key_step = order[valid], self.seq[valid], self.step[valid]
        perm = torch.argsort(key_order, stable=True)
        perm = perm[torch.argsort(key_seq[perm], stable=True)]
        perm = perm[torch.argsort(key_step[perm], stable=True)]
        rows = rows[perm]
        m = rows.numel()
        if m == 0:
            return _WindowIndex(rows, rows, rows, 0)
        seg_key_step, seg_key_seq = self.step[rows], self.seq[rows]
        boundary = torch.ones(m, dtype=torch.bool, device=self.device)  # True where row i is last of its segment
        boundary[:-1] = (seg_key_step[1:] != seg_key_step[:-1]) | (seg_key_seq[1:] != seg_key_seq[:-1])
        idx = torch.arange(m, device=self.device)
        # segment end = first boundary at or after i: reverse cumulative min of boundary positions
        ends = torch.where(boundary, idx, torch.full_like(idx, m))
        ends = torch.flip(torch.cummin(torch.flip(ends, [0]), 0).values, [0])
        starts_cum = torch.cumsum(ends > idx, 0)
        return _WindowIndex(rows, ends, starts_cum, int(starts_cum[-1]))

    def sample(
        self,
        batch: int,  # windows
        window: int,  # max rows per window (>= 2: a training pair needs two consecutive rows)
        generator: torch.Generator | None = None,  # window starts; a generator of the buffer's device
        device: torch.device | str | None = None,  # where the batch goes (default: the buffer's device)
        dtype: torch.dtype | None = None,  # hidden dtype of the batch (default: storage dtype)
    ) -> Batch | None:
        """Random windows of consecutive rows of one sequence, starts uniform over the rows that have a successor;
        None when no sequence has two rows yet. Fixed shapes, no host sync while the index is cached."""
        self.flush()
        if self._index is None:
            self._index = self._build_index()
        ix = self._index
        if ix.n_starts == 0:
            return None
        m = ix.rows.numel()
        # the k-th window start (k uniform) is the first sorted row whose running start count exceeds k
        u = torch.rand(batch, generator=generator, device=self.device, dtype=torch.float64)
        k = (u * ix.n_starts).long()  # [B] in [0, n_starts)
        pick = torch.searchsorted(ix.starts_cum, k, right=True)  # [B] sorted positions
        offs = torch.arange(window, device=self.device)
        lengths = (ix.ends[pick] - pick + 1).clamp_max(window)  # [B] >= 2
        valid = offs[None, :] < lengths[:, None]  # [B, W]
        src = ix.rows[(pick[:, None] + offs[None, :]).clamp_max(m - 1)]
        src = torch.where(valid, src, src[:, :1])  # padding repeats the window's first row (masked in the loss)
        out_dev = torch.device(device) if device is not None else self.device
        hid = self.hidden[src.reshape(-1)].view(batch, window, self.width)
        return Batch(
            tokens=self.tokens[src].to(out_dev, non_blocking=True),
            hidden=hid.to(out_dev, dtype or self.hidden.dtype, non_blocking=True),
            lengths=lengths.to(out_dev, non_blocking=True),
        )

    # ------------------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The live rows with their ring slots and the write position (host tensors): a resumed run samples the
        same windows and overwrites the same slots as the uninterrupted one. Size: live rows x (F x dtype + 24) B."""
        self.flush()
        live = torch.nonzero(self.step >= 0).squeeze(1)
        return {
            "capacity": self.capacity, "width": self.width, "written": self.written, "current_step": self.current_step,
            "slots": live.cpu(), "hidden": self.hidden[live].cpu(), "tokens": self.tokens[live].cpu(),
            "seq": self.seq[live].cpu(), "step": self.step[live].cpu(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["capacity"], state["width"]) != (self.capacity, self.width):
            raise ValueError(f"buffer checkpoint holds a ring of {state['capacity']} x {state['width']}, this buffer "
                             f"is {self.capacity} x {self.width} (drafter.buffer_gb or the model changed)")
        self.step.fill_(-1)
        slots = state["slots"].to(self.device)
        self.hidden.index_copy_(0, slots, state["hidden"].to(self.device, self.hidden.dtype))
        self.tokens.index_copy_(0, slots, state["tokens"].to(self.device))
        self.seq.index_copy_(0, slots, state["seq"].to(self.device))
        self.step.index_copy_(0, slots, state["step"].to(self.device))
        self.written, self.current_step = int(state["written"]), int(state["current_step"])
        self._index = None

    def token_counts(self, vocab_size: int) -> torch.Tensor:  # [V] how often each token occurs in the buffer
        t = self.tokens[self.step >= 0]
        return torch.bincount(t, minlength=vocab_size)[:vocab_size]


class EngineCapture:
    """The rollout engine's `hidden_hook` -> `HiddenStateBuffer.capture`, response rows only.

    The engine reports every position whose K/V entered its cache with (request, sample) ids. The first call that
    mentions a request is its prefill (the prompt of sample 0; siblings share that K/V and report nothing): those rows
    are dropped except the prompt's last one, whose hidden state predicts the first response token. Rows of later
    calls are response tokens. Sequence ids are integers `(rollout << 40) + request * max_samples + sample`.
    """

    def __init__(self, buffer: HiddenStateBuffer, max_samples: int = 4096) -> None:
        self.buffer, self.max_samples = buffer, max_samples
        self._seen: set[int] = set()
        self.epoch = 0  # rollouts seen: keeps ids of different generate() calls apart
        # the sequences of the last call, all seen, and their ids: a speculative step reports the same ones each step
        self._last: tuple[object, list[int]] | None = None

    def reset(self) -> None:
        """Call before each new rollout (`Engine.generate` numbers requests from 0 again)."""
        self._seen.clear()
        self._last = None
        self.epoch += 1

    def __call__(
        self,
        seq_ids: list[tuple[int, int]],  # [N] (request, sample) of each row
        token_ids: torch.Tensor,  # [N]
        hidden: torch.Tensor,  # [N, F]
    ) -> None:
        n = len(seq_ids)
        if n == 0:
            return
        runs = seq_runs(seq_ids)  # a plain-decode window of 256 rows x 8 steps is 256 runs of 8
        ident = runs_ident(seq_ids, runs)
        cached = self._last is not None and self._last[0] == ident  # the same sequences as last call: all seen
        if cached:
            assert self._last is not None
            run_ids = self._last[1]
        else:
            base = self.epoch << 40
            run_ids = [base + r * self.max_samples + s for (r, s), _ in runs]
        ids: list[int] = []
        for i, (_, size) in zip(run_ids, runs, strict=True):
            ids += [i] * size
        dev = hidden.device
        new = set() if cached else {r for (r, _), _ in runs if r not in self._seen}
        if not new:
            self._last = (ident, run_ids)
            self.buffer.capture(ids, token_ids, hidden, defer=True)  # the engine's rows: fresh tensors
            return
        keep = [True] * n
        for i, (r, _) in enumerate(seq_ids):
            # a prompt row unless it is the last row of that request's prefill in this call
            if r in new and not (i + 1 == n or seq_ids[i + 1][0] != r):
                keep[i] = False
        self._seen |= new
        self._last = None
        k = np.array(keep)
        rows = to_device_no_sync(np.nonzero(k)[0], dev)
        self.buffer.capture([i for i, kept in zip(ids, keep, strict=True) if kept], token_ids[rows], hidden[rows],
                            defer=True)
