"""The plain decode loop's windows: up to `EngineConfig.sync_every` decode steps, then one host read of their emitted
counts and the done flags that `Engine.sync` needs -- with one window of run-ahead on CUDA.

Reading a window right after launching it leaves the GPU idle while the host reads, bookkeeps and launches the next
window: 16 us per step at batch 1 and 18 us at batch 8 on an H200 (a step is 0.65-0.71 ms), and the hidden-state hook
(the online drafter's capture) adds about 1 ms of host work per window. So the next window is launched BEFORE the
previous one is read: the read copies into pinned memory behind its own window (an event marks it), and while the
host waits for it, hands the window's hidden states to the hook and plans, the GPU already runs the next window.
What that costs:
- the host learns of finished rows one window later: they stay in the batch for up to `sync_every` more steps
  (finished rows commit nothing; the batch bucket may stay wider) and waiting requests join one window later;
- after the last row finishes, at most one window runs for nothing. Not when every row finishes by its token budget,
  which the host knows (`row_hi`, `row_cap`): no window is launched ahead past the point where all rows are capped.
On CPU every window is read at once (no stream to overlap with; `overlap` forces the schedule for tests).

Hidden states: a window takes the plain steps' stash (rollout/hidden_rows.py) with the rows it ran on, and its one
read also brings each row's emitted count, so the hook gets the window's rows without another device read, whenever
the window is read, even after `Engine.sync` has moved rows.

The adaptive loop (rollout/adaptive_loop.py) plans each step of a window (`next_label`: a label to run one more plain
step under, or None to end the window early, e.g. before a speculative step: such a window is read at once) and
records the steps when they are read (`on_read`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from worker.tlt.rollout.engine_state import EngineState, StepRunner
from worker.tlt.rollout.hidden_rows import WindowHidden, emit_window, flush_hidden, take_window_stash
from worker.tlt.rollout.types import StepStats

# (this window's steps, the label each was planned under) -> the steps to keep (e.g. with their arm's name)
OnRead = Callable[[list[StepStats], list[Any]], list[StepStats]]


@dataclass
class _Window:
    active: int  # rows 0..active-1 were active when it was launched
    batch: int  # the graphs' batch bucket
    k: int  # steps
    packed: torch.Tensor  # [k + active (+ active)] emitted per step, the done flags, each row's emitted count
    ready: torch.cuda.Event | None  # recorded right after the copy into `packed` (CUDA)
    t0: float  # launch time
    rows_version: int  # EngineState.rows_version at launch: its done flags index the rows as they were then
    labels: list[Any]  # per step: what the caller planned it under
    hidden: WindowHidden | None  # the steps' hidden states for the hook


class PlainWindows:
    def __init__(self, state: EngineState, runner: StepRunner, overlap: bool | None = None,
                 on_read: OnRead | None = None) -> None:
        """runner: whose decode_step the windows launch; overlap: run one window ahead of the reads (default: on
        CUDA; tests force it on CPU, where a window's values are final at launch); on_read: called with each window's
        steps as they are read."""
        self.state, self.runner, self.on_read = state, runner, on_read
        self.overlap = state.device.type == "cuda" if overlap is None else overlap
        self.inflight: _Window | None = None
        self._t_read = 0.0  # when the last read finished: a window's seconds start there at the earliest

    def step(self, steps: list[StepStats], first: Any = None,
             next_label: Callable[[], Any | None] | None = None) -> bool:
        """Launch a window (its first step labelled `first`, each further one by `next_label()` until that returns
        None) and read the oldest unread one -> True when the host got done flags for the current rows (call
        Engine.sync), False when the window only went ahead or the rows changed since the read window began."""
        new = self._launch(first, next_label)
        old = self.inflight
        cut = new.k < self.state.config.sync_every  # the caller stopped the window: it reads it now
        ahead = self.overlap and not cut and self._can_run_ahead()
        if old is None:
            if ahead:
                self.inflight = new
                return False
            return self._read(new, steps)
        self.inflight = new
        fresh = self._read(old, steps)
        if not ahead:  # nothing left to overlap with (rows at their budget), or the caller stops plain decoding
            self.inflight = None
            fresh = self._read(new, steps) or fresh
        return fresh

    def drain(self, steps: list[StepStats]) -> bool:
        """Read the window still in flight, if any (before a speculative step; generate's end) -> whether the host
        got done flags for the current rows."""
        if self.inflight is None:
            return False
        win, self.inflight = self.inflight, None
        return self._read(win, steps)

    def _can_run_ahead(self) -> bool:
        """Some active row has token budget left past the windows launched so far: a row's length is its prompt plus
        n_gen - 1 (the root's K/V enters at the next step), row_hi bounds it from above."""
        eng = self.state
        n = eng.n_active
        return bool((eng.row_hi[:n] + 1 < eng.row_cap[:n]).any())

    def _launch(self, first: Any, next_label: Callable[[], Any | None] | None) -> _Window:
        eng = self.state
        active, batch, k = eng.n_active, eng.bucket(eng.n_active), eng.config.sync_every
        flush_hidden(eng)  # steps run outside a window (direct decode_step calls) reach the hook first
        t0 = eng.clock()
        labels, emitted = [first], [self.runner.decode_step(batch).sum()]
        while len(emitted) < k:
            label = None
            if next_label is not None and (label := next_label()) is None:
                break
            labels.append(label)
            emitted.append(self.runner.decode_step(batch).sum())
        hidden = take_window_stash(eng, active)
        parts = [torch.stack(emitted), eng.rows.done[:active].to(torch.int64)]
        if hidden is not None:
            parts.append(hidden.n_kept)
        packed = torch.cat(parts)
        ready = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            packed = host
        return _Window(active, batch, len(emitted), packed, ready, t0, eng.rows_version, labels, hidden)

    def _read(self, win: _Window, steps: list[StepStats]) -> bool:
        """The window's step records and hook rows; its done flags -> EngineState.done_host if the rows are still
        those it ran on."""
        if win.ready is not None:
            win.ready.synchronize()
        vals = win.packed.tolist()
        now = self.state.clock()
        dt = (now - max(win.t0, self._t_read)) / win.k
        self._t_read = now
        if win.hidden is not None:
            emit_window(self.state, win.hidden, vals[win.k + win.active:])
        recs = [StepStats("decode", win.active, win.batch, 1, int(c), 0, dt) for c in vals[: win.k]]
        steps += self.on_read(recs, win.labels) if self.on_read is not None else recs
        eng = self.state
        if win.rows_version != eng.rows_version:  # a sync moved rows since (or a prefill added some)
            return False
        # set after the next window's launch (decode_step clears them): stale by up to that window, so a subset of
        # the rows done by now -- all that Engine.sync needs
        eng.done_host = [bool(x) for x in vals[win.k : win.k + win.active]]
        return True
