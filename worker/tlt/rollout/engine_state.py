"""The rollout engine's state: what its phases (prefill, plain windows, speculative steps, sync) read and write.

`Engine` (rollout/engine.py) owns one `EngineState` and hands it to its phase modules (prefill.py, windows.py,
speculative_step.py, speculative_body.py, speculative_graphs.py, hidden_rows.py, adaptive_loop.py, memory.py); none of them imports
the engine. Device side: the KV cache, the row state (decoding/), the generator and the decode step's forward. Host
side, mirrors of rows 0..n_active-1 that let a step run without reading the device:

- `request_seeds`: the current generate()'s per-request seeds (`begin_generate`), from which prefill keys each
  sequence's random stream (`RowState.key`, decoding/streams.py);
- `row_seq` (request, sample) and `row_sampling` (its request's RequestSampling) per row; `histories`: request -> the
  per-sample token lists (prompt + emitted) that drafters read, filled lazily (`sync_histories`);
- `row_hi` an upper bound of each row's length (picks the attention length), `row_cap` prompt + max_new_tokens,
  `row_known` emitted tokens already in `histories`, `row_plen` prompt lengths;
- `mode` the rows' sampling mode (rollout/decode_step.py) and `rows_version`, new whenever rows 0..n-1 change
  (prefill, sync, a new generate): caches keyed on the rows (the DraftContext, hook consumers) compare it;
- `hist_fresh` / `done_host`: what the last speculative step already read (histories complete, done flags).

Run the tests: `python -m pytest tests/engine -q`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from worker.tlt.decoding.kv_cache import KVCache, pages_for_budget, slots_for_budget
from worker.tlt.decoding.pages import PagePool
from worker.tlt.decoding.row_state import RowState
from worker.tlt.decoding.streams import request_seed, sequence_key
from worker.tlt.decoding.uploads import HostStage
from worker.tlt.kernels import resolve_fused
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.decode_step import GREEDY, DecodeStep, Mode, sampling_mode
from worker.tlt.rollout.types import EngineConfig, RequestSampling, StepStats
from worker.tlt.speculative.arm import Arm
from worker.tlt.speculative.proposers.protocol import DraftContext
from worker.tlt.speculative.verify.accept_stats import AcceptanceStats

# versions of an engine's rows, unique across engines: hook consumers cache per (version, rows) (decoding/uploads.SeqIds)
_ROWS_VERSIONS = itertools.count()

# (seq ids, tokens [N], hidden [N, H] or [N, (k+1)H] with EngineConfig.capture_layers)
HiddenHook = Callable[[list[tuple[int, int]], torch.Tensor, torch.Tensor], None]


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class StepRunner(Protocol):
    """The engine's two decode phases, as the adaptive loop and the plain windows drive them."""

    def decode_step(self, batch: int) -> torch.Tensor:  # -> tokens emitted per row [B] (device)
        ...

    def speculative_step(self, batch: int, arm: Arm) -> StepStats:
        ...


class EngineState:
    def __init__(self, model: Transformer, config: EngineConfig, eos_ids: Sequence[int], max_nodes: int,
                 hidden_hook: HiddenHook | None, clock: Callable[[], float] = time.perf_counter) -> None:
        """max_nodes: the widest verify the engine will run (KV headroom past a row's length)."""
        bad = [i for i in config.capture_layers if not 0 <= i < model.args.n_layers]
        if bad:
            raise ValueError(f"capture_layers {bad} outside the model's {model.args.n_layers} layers")
        self.model, self.config, self.eos_ids = model, config, tuple(eos_ids)
        self.hidden_hook, self.clock = hidden_hook, clock
        w = model.head_weight
        self.device, self.dtype = w.device, w.dtype
        self.max_nodes, self.max_len = max_nodes, config.max_len
        t = round_up(config.max_len + max_nodes + 2, 64)  # headroom: a verify writes up to max_nodes columns
        self.pages: PagePool | None = None  # the paged layout's allocator (rollout/paging.py), None: rows
        page = config.page_size
        if page is not None and page < t:
            t = round_up(t, page)
            n_pages = config.kv_pages or (
                config.max_slots * (t // page) + 1 if config.max_slots
                else pages_for_budget(model.args, page, config.kv_cache_gb, self.dtype))
            slots = config.max_slots or min(n_pages - 1, max(config.batch_buckets))
            self.cache = KVCache.allocate(model.args, slots, t, self.device, self.dtype, page_size=page,
                                          n_pages=n_pages)
            self.pages = PagePool(n_pages, page, slots, t // page)
        else:
            slots = config.max_slots or slots_for_budget(model.args, t, config.kv_cache_gb, self.dtype)
            self.cache = KVCache.allocate(model.args, slots, t, self.device, self.dtype)
        if model.rope_cos.shape[0] < t:
            model.init_rope(self.device, t)
        self.rows = RowState(slots, t, config.max_len, max_nodes + 1, self.device)
        self.gen = torch.Generator(device=self.device).manual_seed(config.seed)
        self.cols = torch.arange(t, device=self.device)
        on_cuda = self.device.type == "cuda"
        fused = resolve_fused(config.fused_kernels, model.args, self.device, self.dtype)
        self.request_seeds: list[int] = []  # per request of the current generate() (begin_generate)
        self.step = DecodeStep(model, self.cache, self.rows,
                               compile_max_batch=config.compile_max_batch if config.compile and on_cuda else 0,
                               compile_mode=config.compile_mode, capture_layers=config.capture_layers, fused=fused,
                               fused_max_seqs=config.fused_max_seqs)
        self.n_active = 0
        self.row_seq: list[tuple[int, int]] = []  # (request, sample) per active row
        self.row_sampling: list[RequestSampling] = []  # per active row: its request's settings
        self._row_hi = np.zeros(slots, dtype=np.int64)  # see `row_hi`
        self.plain_steps = 0  # plain decode steps not yet added to _row_hi
        self._hi_max: int | None = None  # max of _row_hi over the active rows (None: recompute)
        self.mode: Mode = GREEDY
        self.row_cap = np.zeros(slots, dtype=np.int64)
        self.row_known = np.zeros(slots, dtype=np.int64)
        self.row_plen = np.zeros(slots, dtype=np.int64)
        self.row_age = np.zeros(slots, dtype=np.int64)  # admission order (paging preempts the youngest)
        self.admitted = 0  # sequences admitted so far (the next row_age)
        self.hist_fresh = False  # histories hold every emitted token of rows 0..n-1 (no device read needed)
        self.done_host: list[int] | None = None  # done flags of rows 0..n-1 read by the last speculative step
        self.rows_version = next(_ROWS_VERSIONS)
        # speculative.draft_context's cache: (key, context, its histories)
        self.spec_ctx: tuple[tuple[int, ...], DraftContext, list[list[int]]] | None = None
        # plain steps' (roots [B], hidden [B, H], emitted [B], batch) awaiting the hidden-state hook (hidden_rows.py)
        self.pending_hidden: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        self.hook_stage = HostStage(self.device)  # a speculative step's hook rows index: one upload per step
        self.hook_flat: tuple[torch.Tensor, torch.Tensor] | None = None  # (hidden, its [B*K, F] view)
        self.histories: dict[int, list[list[int]]] = {}
        self.accept_stats = AcceptanceStats()  # speculative steps of the last generate() (speculative/verify/accept_stats.py)

    def begin_generate(self, requests: Sequence[RequestSampling]) -> None:
        """The seeds of a generate() call's requests: a request's own `seed`, else one derived from a base seed
        drawn from the engine's generator (one draw per call, whatever the requests, steps or preemptions, so a
        checkpointed generator resumes the same streams)."""
        base = int(torch.randint(0, 1 << 62, (1,), generator=self.gen, device=self.gen.device))
        self.request_seeds = [p.seed if p.seed is not None else request_seed(base, r) for r, p in enumerate(requests)]

    def sequence_keys(self, seqs: Sequence[tuple[int, int]]) -> list[int]:
        """The stream keys of (request, sample) pairs of the current generate() (RowState.key)."""
        return [sequence_key(self.request_seeds[r], smp) for r, smp in seqs]

    @property
    def slots(self) -> int:
        return self.rows.slots  # the cache's rows (also while it is released)

    @property
    def row_hi(self) -> np.ndarray:
        """Upper bound of lens per row (picks the attention length), capped at prompt + max_new_tokens. Plain decode
        steps only count themselves; this brings the array up to date, and since callers may write into it, the
        cached maximum is recomputed at the next step."""
        if self.plain_steps:
            n = self.n_active
            self._row_hi[:n] = np.minimum(self._row_hi[:n] + self.plain_steps, self.row_cap[:n])
            self.plain_steps = 0
        self._hi_max = None
        return self._row_hi

    def active_hi(self) -> int:
        """max(row_hi) over the active rows, without touching the array while only plain steps run."""
        if self._hi_max is None:
            hi = self.row_hi  # folds the pending steps in (and drops the cached maximum, set right below)
            self._hi_max = int(hi[: self.n_active].max()) if self.n_active else 0
        return self._hi_max + self.plain_steps

    def flush_table(self) -> None:
        """Upload the block-table rows the page pool changed (one copy, stream-ordered behind launched steps)."""
        if self.pages is not None and (dirty := self.pages.take_dirty()) is not None:
            self.cache.upload_table(*dirty)

    def new_rows_version(self) -> None:
        self.rows_version = next(_ROWS_VERSIONS)

    def rows_changed(self) -> None:
        """After prefill / sync: recompute what plain steps cache (sampling mode, attention bound); speculative steps
        build a new DraftContext."""
        self.new_rows_version()
        self.mode = sampling_mode(self.row_sampling) if self.row_sampling else GREEDY
        _ = self.row_hi  # folds pending steps in and drops the cached maximum

    @property
    def hook_layers(self) -> tuple[int, ...]:
        """Layers an eager forward captures for the hook: EngineConfig.capture_layers while a hook is attached."""
        return self.config.capture_layers if self.hidden_hook is not None else ()

    def bucket(self, n: int) -> int:
        for b in self.config.batch_buckets:
            if b >= n:
                return min(b, self.slots)
        return self.slots

    def tk_of(self, hi: int) -> int:
        """Attention columns for rows at most `hi` long: bucketed by EngineConfig.attn_bucket."""
        return min(round_up(max(hi, 1), self.config.attn_bucket), self.cache.max_len)

    def tk(self, n_rows: int, extra: int) -> int:
        return self.tk_of(int(self.row_hi[:n_rows].max()) + extra if n_rows else extra)

    def decode_tk(self, batch: int, hi: int) -> int:
        """Attention length of a plain decode step: bucketed, or the full cache for compiled batches."""
        if self.step.compiled(batch):  # one shape per batch bucket: compiled once
            return self.cache.max_len
        return self.tk_of(hi)

    def sync_histories(self, n: int) -> None:
        """Append the tokens emitted since the last call to the host histories of rows 0..n-1 (one copy)."""
        n_gen = self.rows.n_gen[:n].cpu().numpy()
        known = self.row_known[:n]
        lo, hi = int(known.min()), int(n_gen.max())
        self.hist_fresh = n == self.n_active
        if hi <= lo:
            return
        block = self.rows.out_tok[:n, lo:hi].cpu().tolist()
        for b, (r, s) in enumerate(self.row_seq[:n]):
            self.histories[r][s].extend(block[b][known[b] - lo : n_gen[b] - lo])
        self.row_known[:n] = n_gen
