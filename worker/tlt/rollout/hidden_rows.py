"""The hidden-state hook's rows: what the engine hands `hidden_hook(seq_ids, token_ids, hidden)` after its steps.

Every position whose K/V entered the cache (prompt tokens at prefill, roots, accepted drafts) reaches the hook once,
in position order per sequence, with its final-norm hidden state (with EngineConfig.capture_layers, the captured
layers' inputs too). Plain decode steps are stashed (`EngineState.pending_hidden`); a plain window (rollout/windows.py)
takes its steps' stash with the rows they ran on (`take_window_stash`) and hands it over when its one host read
brings each row's emitted count (`emit_window`: no further device read, and after `Engine.sync` moved rows just as
well); steps run outside a window are handed over at the next sync or speculative step (`flush_hidden`). A
speculative step's kept nodes go right after its one host read (`emit_hidden` with the counts already on the host).

Run the tests: `python -m pytest tests/engine/test_engine_capture_layers.py tests/drafter/test_drafter_host_path.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.tlt.decoding.uploads import SeqIds
from worker.tlt.rollout.engine_state import EngineState


def stash_plain_step(state: EngineState, roots: torch.Tensor, hidden: torch.Tensor, emitted: torch.Tensor,
                     batch: int) -> None:
    """Keep a plain step's roots [B], hidden [B, F] and emitted [B] for the next flush (clones: a graph's outputs
    are overwritten by the next replay)."""
    if state.pending_hidden and state.pending_hidden[0][3] != batch:
        flush_hidden(state)
    state.pending_hidden.append((roots.clone(), hidden.clone(), emitted.clone(), batch))


@dataclass
class WindowHidden:
    """A plain window's stashed steps: roots [B, W], hidden [B, W, F], each active row's emitted count [active]
    (device, read with the window), and the rows they ran on."""

    roots: torch.Tensor
    hidden: torch.Tensor
    n_kept: torch.Tensor
    batch: int
    row_seq: list[tuple[int, int]]
    rows_version: int


def take_window_stash(state: EngineState, active: int) -> WindowHidden | None:
    """The stash of the window just launched over rows 0..active-1 (device work only), or None without a hook."""
    if not state.pending_hidden:
        return None
    pend, state.pending_hidden = state.pending_hidden, []
    n_kept = torch.stack([p[2] for p in pend], 1)[:active].sum(1).to(torch.int64)
    return WindowHidden(torch.stack([p[0] for p in pend], 1), torch.stack([p[1] for p in pend], 1), n_kept,
                        pend[0][3], list(state.row_seq[:active]), state.rows_version)


def emit_window(state: EngineState, win: WindowHidden, n_host: list[int]) -> None:
    """Hand a read window's rows to the hook; n_host: each row's emitted count, as the window's read brought it."""
    emit_hidden(state, win.batch, win.roots, win.hidden, win.n_kept, n_host, row_seq=win.row_seq,
                rows_version=win.rows_version)


def flush_hidden(state: EngineState) -> None:
    """Hand the stashed plain steps' hidden states to the hook: one [B, W] block, in token order (a row emits 1 token
    per step until it finishes, then 0, so its kept entries are a prefix); reads the counts from the device."""
    win = take_window_stash(state, state.n_active)
    if win is not None:
        emit_hidden(state, win.batch, win.roots, win.hidden, win.n_kept)


def emit_hidden(state: EngineState, batch: int, toks: torch.Tensor, hidden: torch.Tensor, n_kept: torch.Tensor,
                n_host: list[int] | None = None, row_seq: Sequence[tuple[int, int]] | None = None,
                rows_version: int | None = None) -> None:
    """toks [B', K], hidden [B', K', H or (k+1)H], n_kept [B]: the first n_kept[b] entries of rows b < batch (at
    most min(K, K')) go to the hook (rows past the batch, a graph's padding, are never read). n_host: the same
    counts already read to the host (a speculative step's one read): the rows are then picked with a host-built
    index of both tensors, one upload, no further device sync (a boolean mask costs three) and no view of the
    inputs (a graph's static outputs: their flat view is kept); the hook's seq ids carry their runs
    (decoding/uploads.SeqIds). row_seq / rows_version: the rows the tensors were computed on, when those are no
    longer the engine's current rows (a window read after a sync)."""
    hook = state.hidden_hook
    assert hook is not None
    if row_seq is None:
        row_seq, rows_version = state.row_seq, state.rows_version
    rows = min(batch, len(row_seq))  # row_seq holds the active rows only
    if n_host is None:
        keep = state.cols[: toks.shape[1]][None, :] < n_kept[:rows, None]
        counts = keep.sum(1).tolist()
        seq = [row_seq[b] for b in range(rows) for _ in range(counts[b])]
        hook(seq, toks[:rows][keep], hidden[:rows][keep])
        return
    kt, kh = toks.shape[1], hidden.shape[1]
    k = min(kt, kh)
    at_t: list[int] = []  # flat index of each kept entry in toks (Python: ~16 entries)
    runs, seq = [], []
    for b, (sid, c) in enumerate(zip(row_seq[:rows], n_host[:rows], strict=True)):
        if c:
            c = min(c, k)
            at_t += range(b * kt, b * kt + c)
            runs.append((sid, c))
            seq += [sid] * c
    if kh == kt:  # the same flat index in both (a chain verified at its own width)
        it = ih = state.hook_stage.put(at_t)[0]
    else:
        it, ih = state.hook_stage.put(at_t, [i // kt * kh + i % kt for i in at_t])
    kept = state.hook_flat
    flat = kept[1] if kept is not None and kept[0] is hidden else hidden.flatten(0, 1)
    if hidden.is_contiguous():  # a view: still this tensor's rows at the next step (a copy would not be)
        state.hook_flat = (hidden, flat)
    key = (rows_version, rows) if len(runs) == rows else None  # every row: its sequences are row_seq's
    hook(SeqIds(runs, seq, key), torch.take(toks, it), flat.index_select(0, ih))
