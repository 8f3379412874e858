"""Host -> device uploads that never wait on the device, and the ids the engine's hidden-state hook hands over.

- `to_device_no_sync(arr, device)`: a host array on the device through pinned staging (non_blocking);
- `HostStage`: a caller's per-step uploads through one reused pinned buffer (one copy per call);
- `SeqIds`: the hook rows' sequence ids together with their runs (`seq_runs` returns them without regrouping),
  and a key that identifies the sequence list for consumers that cache per list (`runs_ident`).

Part of the bottom layer (worker/tlt/decoding): the engine, the kernels and the drafters import it.
Run the tests: `python -m pytest tests/drafter/test_drafter_host_path.py -q`.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import numpy as np
import torch


class SeqIds(list):  # type: ignore[type-arg]
    """Hook rows' sequence ids (a list of (request, sample), one per row) built from their runs, which it keeps:
    `seq_runs` returns them as they are instead of grouping the rows again (the engine's speculative step builds
    these; any plain list works as well)."""

    __slots__ = ("runs", "key")

    def __init__(self, runs: list[tuple[tuple[int, int], int]], rows: list[tuple[int, int]] | None = None,
                 key: Hashable | None = None) -> None:
        """runs: (sequence, rows > 0) per run; rows: the per-row list if already built; key: equal keys mean the
        same sequences in the same order (unique across engines and rollouts), so a consumer caching per sequence
        list may compare keys instead of lists."""
        super().__init__(rows if rows is not None else (sid for sid, n in runs for _ in range(n)))
        self.runs = runs
        self.key = key


def runs_ident(seq_ids: Sequence[tuple[int, int]], runs: list[tuple[tuple[int, int], int]]) -> object:
    """What identifies the sequences of these runs, in order, for a cache: SeqIds.key, or the list of them."""
    key = getattr(seq_ids, "key", None)
    return key if key is not None else [sid for sid, _ in runs]


def seq_runs(seq_ids: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, int], int]]:
    """(sequence, row count) of each run of consecutive rows of one sequence: the engine's hook reports a sequence's
    rows together, so per-run Python replaces per-row Python."""
    runs = getattr(seq_ids, "runs", None)
    if runs is not None:
        return runs
    return [(sid, len(list(rows))) for sid, rows in itertools.groupby(seq_ids)]


def to_device_no_sync(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting for the device: pinned staging and a non_blocking copy (a pageable
    copy would synchronise the stream)."""
    t = torch.from_numpy(arr)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class HostStage:
    """The per-step host -> device copies of one caller without `to_device_no_sync`'s pinned allocation per call:
    int64 values are written into one host buffer (pinned on CUDA; off CUDA the "device" buffer itself, so nothing
    is copied) and copied at once into one device buffer. Tensors it returns are views of that buffer, valid until
    its next use. The pinned buffer is rewritten only once the copy that last read it has completed (an event
    query: a caller that reads a result back every step, as the engine does, never waits)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._host = torch.zeros(0, dtype=torch.int64)  # [cap] pinned on CUDA
        self._np = self._host.numpy()  # the same memory
        self._dev = self._host  # [cap] on the device (off CUDA: _host)
        self._event: torch.cuda.Event | None = None  # recorded after the last copy out of _host
        self._own: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # off CUDA: id(dst) -> (dst, its numpy view)
        self._lent: np.ndarray | None = None  # on CUDA: the host array host_for handed out last (same one next time)

    def _room(self, n: int) -> np.ndarray:  # the host buffer, free to write, with room for n values
        if len(self._np) < n:
            if self._event is not None:
                self._event.synchronize()
            cap = max(n, 2 * len(self._np), 1024)
            self._host = torch.empty(cap, dtype=torch.int64, pin_memory=self._cuda)
            self._np = self._host.numpy()
            self._dev = torch.empty(cap, dtype=torch.int64, device=self.device) if self._cuda else self._host
            self._event = torch.cuda.Event() if self._cuda else None
        elif self._event is not None and not self._event.query():
            self._event.synchronize()  # only when a caller uploads twice without reading anything back
        return self._np

    def put(self, *parts: Sequence[int] | np.ndarray) -> list[torch.Tensor]:
        """Each part on the device (1-D int64 views of one buffer), with one copy in all."""
        self._lent = None  # its contents change
        ends, o = [], 0
        for part in parts:
            o += len(part)
            ends.append(o)
        host = self._room(o)
        o = 0
        for part, end in zip(parts, ends, strict=True):
            host[o:end] = part
            o = end
        if self._cuda:
            self._dev[:o].copy_(self._host[:o], non_blocking=True)
            assert self._event is not None
            self._event.record()
        dev, o, out = self._dev, 0, []
        for end in ends:
            out.append(dev[o:end])
            o = end
        return out

    def host_for(self, dst: torch.Tensor) -> np.ndarray:
        """A flat host array to fill with the values of `dst` (contiguous int64), then `send(dst)`: off CUDA dst's
        own memory (nothing to copy), on CUDA the pinned buffer. The same array object comes back while nothing else
        wrote into it (the caller may keep views of it, and rely on what it wrote there last)."""
        if not self._cuda:
            own = self._own.get(id(dst))
            if own is None or own[0] is not dst:
                own = self._own[id(dst)] = (dst, dst.view(-1).numpy())
            return own[1]
        host = self._room(dst.numel())
        if self._lent is None or self._lent.base is not host or len(self._lent) != dst.numel():
            self._lent = host[: dst.numel()]
        return self._lent

    def send(self, dst: torch.Tensor) -> None:  # dst <- what was written into host_for(dst)
        if self._cuda:
            dst.view(-1).copy_(self._host[: dst.numel()], non_blocking=True)
            assert self._event is not None
            self._event.record()
