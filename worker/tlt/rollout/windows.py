"""The plain decode loop's windows: `EngineConfig.sync_every` decode steps, then one host read of their emitted counts
and the done flags that `Engine.sync` needs -- with one window of run-ahead on CUDA.

Reading a window right after launching it leaves the GPU idle while the host reads, bookkeeps and launches the next
window: 16 us per step at batch 1 and 18 us at batch 8 on an H200 (a step is 0.65-0.71 ms). So the
next window is launched BEFORE the previous one is read: the read copies into pinned memory behind its own window
(an event marks it), and while the host waits for it the GPU already runs the next window. What that costs:
- the host learns of finished rows one window later: they stay in the batch for up to `sync_every` more steps
  (finished rows commit nothing; the batch bucket may stay wider) and waiting requests join one window later;
- after the last row finishes, at most one window runs for nothing. Not when every row finishes by its token budget,
  which the host knows (`row_hi`, `row_cap`): no window is launched ahead past the point where all rows are capped.
On CPU every window is read at once (no stream to overlap with; `overlap` forces the schedule for tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker.tlt.rollout.types import StepStats

if TYPE_CHECKING:
    from worker.tlt.rollout.engine import Engine


@dataclass
class _Window:
    active: int  # rows 0..active-1 were active when it was launched
    batch: int  # the graphs' batch bucket
    k: int  # steps
    packed: torch.Tensor  # [k + active] emitted per step, then the done flags (pinned host memory on CUDA)
    ready: torch.cuda.Event | None  # recorded right after the copy into `packed` (CUDA)
    t0: float  # launch time
    rows_version: int  # Engine._rows_version at launch: its done flags index the rows as they were then


class PlainWindows:
    def __init__(self, engine: Engine, overlap: bool | None = None) -> None:
        """overlap: run one window ahead of the reads (default: on CUDA; tests force it on CPU, where a window's
        values are final at launch)."""
        self.engine = engine
        self.overlap = engine.device.type == "cuda" if overlap is None else overlap
        self.inflight: _Window | None = None
        self._t_read = 0.0  # when the last read finished: a window's seconds start there at the earliest

    def step(self, steps: list[StepStats]) -> bool:
        """Launch a window and read the oldest unread one -> True when the host got done flags for the current rows
        (call Engine.sync), False when the window only went ahead or the rows changed since the read window began."""
        new = self._launch()
        old = self.inflight
        if old is None:
            if self.overlap and self._can_run_ahead():
                self.inflight = new
                return False
            return self._read(new, steps)
        self.inflight = new
        fresh = self._read(old, steps)
        if not self._can_run_ahead():  # every row is at its budget once `new` ran: nothing left to overlap with
            self.inflight = None
            fresh = self._read(new, steps) or fresh
        return fresh

    def drain(self, steps: list[StepStats]) -> None:
        """Read the window still in flight, if any (generate's end: it ran after the last row finished)."""
        if self.inflight is not None:
            win, self.inflight = self.inflight, None
            self._read(win, steps)

    def _can_run_ahead(self) -> bool:
        """Some active row has token budget left past the windows launched so far: a row's length is its prompt plus
        n_gen - 1 (the root's K/V enters at the next step), row_hi bounds it from above."""
        eng = self.engine
        n = eng.n_active
        return bool((eng.row_hi[:n] + 1 < eng.row_cap[:n]).any())

    def _launch(self) -> _Window:
        eng = self.engine
        active, batch, k = eng.n_active, eng.bucket(eng.n_active), eng.config.sync_every
        t0 = time.perf_counter()
        emitted = [eng.decode_step(batch).sum() for _ in range(k)]
        packed = torch.cat([torch.stack(emitted), eng.rows.done[:active].to(torch.int64)])
        ready = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            packed = host
        return _Window(active, batch, k, packed, ready, t0, eng._rows_version)

    def _read(self, win: _Window, steps: list[StepStats]) -> bool:
        """The window's step records; its done flags -> Engine._done_host if the rows are still those it ran on."""
        if win.ready is not None:
            win.ready.synchronize()
        vals = win.packed.tolist()
        now = time.perf_counter()
        dt = (now - max(win.t0, self._t_read)) / win.k
        self._t_read = now
        steps += [StepStats("decode", win.active, win.batch, 1, int(c), 0, dt) for c in vals[: win.k]]
        eng = self.engine
        if win.rows_version != eng._rows_version:  # a sync moved rows since (or a prefill added some)
            return False
        # set after the next window's launch (decode_step clears them): stale by up to that window, so a subset of
        # the rows done by now -- all that Engine.sync needs
        eng._done_host = [bool(x) for x in vals[win.k :]]
        return True
