"""The rollout engine: continuous batching over a ragged KV cache, plain and speculative decoding, exact sampling.

    engine = Engine(model, eos_ids=tok.eos_ids, config=EngineConfig(max_len=1024, max_slots=64))
    out = engine.generate([Request(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=256, n=8))])
    out.sequences[i].tokens / .logprobs / .finish_reason;  out.steps: per-step StepStats

Phases (gpt-fast style; `generate()` only orchestrates):
- `prefill(items)`: prompts of newly admitted sequences (one forward per distinct prompt, K/V copied to its
  siblings; small chunks replayed from CUDA graphs, rollout/prefill_graphs.py), first token sampled;
- `decode_step(batch)`: one token for rows 0..batch-1, no host sync: the whole step (forward, processing, sampling
  with the engine's generator, log-probs, commit; rollout/decode_step.py) is one CUDA-graph replay on CUDA
  (rollout/graphs.py; torch.compile'd before capture for small batches with `EngineConfig.compile`), the same body
  run eagerly elsewhere; same seed => same tokens either way; generate() runs windows of `sync_every` steps with
  one host read each, on CUDA one window ahead of the reads (rollout/windows.py);
- `speculative_step(batch, arm=None)`: the proposer drafts a chain or tree per row, ONE target forward verifies all
  rows with the tree mask, spec/verify.py accepts per row, the KV cache keeps only accepted nodes, EOS /
  max_new_tokens cut inside accepted runs; ONE host read at the end (emitted counts, done flags, per-position
  acceptance and the emitted tokens, which extend the host histories directly);
- `sync()`: finished sequences leave (results copied out, `generate(..., on_finish=cb)` calls cb(result) for each
  right then), rows are compacted so active sequences stay in rows 0..n-1, and waiting requests join in the freed
  rows.
Adaptive SD: `Engine(..., adaptive=AdaptiveSd, proposers={"ngram": ..., "eagle": ...})` asks the controller
for an arm every decode step and runs plain decoding or a speculative step with that arm's drafter, depth, top-k and
verify width (rollout/adaptive_loop.py); SD switches on and off mid-generation without re-prefilling, and stays
exactly lossless (the verifier is the same for every arm). The n-gram drafter is always there (cold start); the KV
headroom is sized at construction for the widest arm. `GenerationOutput.sd_metrics` carries the controller's
RolloutSdMetrics summary; `tail_hook(budget_s)` runs between tail steps within a bounded credit.
Randomness comes from one explicit torch.Generator (EngineConfig.seed). Sampling and acceptance use the processed
distribution of spec/sampling.py; log-probs are of emitted tokens under it (greedy rows: log_softmax of the logits).
Hidden-state capture: `hidden_hook(seq_ids, token_ids, hidden [N, H])` is called per step with the final-norm
hidden state at every position whose K/V entered the cache (prompt tokens, roots, accepted drafts); the decode graph
outputs the roots and hidden states too, so hooked runs replay the same graphs. With `EngineConfig.capture_layers`
(EAGLE-3: (2, L//2, L-3)) the hook gets cat(hidden entering each of those layers, final-norm hidden) [N, (k+1)H]
from the same forwards (rollout/decode_step.hook_rows); the decode and verify graphs then output that width.
Memory: `release_memory()` frees the KV cache and every graph that reads it while the engine is idle (the
policy update), `restore_memory()` allocates it again; generate() refuses to run in between (rollout/memory.py).
Host work per plain step: the sampling mode (GREEDY / uniform / MIXED) and the attention-length bound are cached
and only recomputed after prefill, sync or a speculative step. Per speculative step the DraftContext is cached until
the rows change (`_rows_version`), and the hook's rows are picked with one upload through a reused pinned buffer.
Run the tests: `python -m pytest tests/engine -q`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from worker.tlt.adaptive.arms import Arm
from worker.tlt.adaptive.controller import AdaptiveSd
from worker.tlt.drafter.buffer import HostStage, SeqIds
from worker.tlt.kernels import resolve_fused
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout import memory
from worker.tlt.rollout.adaptive_loop import (
    Pending,
    TailBudget,
    TailHook,
    adaptive_iteration,
    proposer_topk,
)
from worker.tlt.rollout.decode_step import GREEDY, DecodeStep, Mode, StepOut, sampling_mode
from worker.tlt.rollout.graphs import DecodeGraphs
from worker.tlt.rollout.kv_cache import KVCache, slots_for_budget
from worker.tlt.rollout.prefill import prefill, round_up
from worker.tlt.rollout.prefill_graphs import PrefillGraphs
from worker.tlt.rollout.speculative import row_filters, speculative_step
from worker.tlt.rollout.state import RowState
from worker.tlt.rollout.types import (
    EngineConfig,
    GenerationOutput,
    Request,
    SamplingParams,
    SequenceResult,
    SpecConfig,
    StepStats,
)
from worker.tlt.rollout.verify_graphs import VerifyGraphs
from worker.tlt.rollout.windows import PlainWindows
from worker.tlt.spec.ngram import NGramProposer
from worker.tlt.spec.proposer import DraftContext, Proposer
from worker.tlt.spec.stats import AcceptanceStats

log = logging.getLogger(__name__)
# versions of an engine's rows, unique across engines: hook consumers cache per (version, rows) (drafter/buffer.SeqIds)
_ROWS_VERSIONS = itertools.count()

# (seq ids, tokens [N], hidden [N, H] or [N, (k+1)H] with EngineConfig.capture_layers)
HiddenHook = Callable[[list[tuple[int, int]], torch.Tensor, torch.Tensor], None]
FinishCallback = Callable[[SequenceResult], None]  # called once per sequence as it leaves the batch


class Engine:
    def __init__(
        self,
        model: Transformer,
        *,
        eos_ids: Sequence[int],
        config: EngineConfig | None = None,
        spec: SpecConfig | None = None,
        proposer: Proposer | None = None,
        hidden_hook: HiddenHook | None = None,
        adaptive: AdaptiveSd | None = None,
        proposers: Mapping[str, Proposer] | None = None,
        tail_hook: TailHook | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """proposer + spec: SD with one fixed drafter and shape (spec.mode "on"). adaptive: the controller plans every
        step (spec is then ignored); proposers: drafter kind -> Proposer for the arms ("ngram" is added when missing:
        the cold-start drafter); tail_hook: called with a time budget between steps run with the switch on; clock:
        step timing (tests pass a deterministic one so that the bandit's choices are reproducible)."""
        self.model = model.eval()
        self.config = config = config or EngineConfig()
        self.spec = spec or SpecConfig()
        self.proposer = proposer
        self.hidden_hook = hidden_hook
        self.adaptive = adaptive
        self.proposers: dict[str, Proposer] = dict(proposers or {})
        if adaptive is not None and "ngram" not in self.proposers:
            self.proposers["ngram"] = NGramProposer()
        arms = adaptive.all_arms() if adaptive is not None else []
        missing = sorted({a.drafter for a in arms if a.is_sd and a.drafter not in self.proposers})
        if missing:
            raise ValueError(f"the controller plans arms with drafters {missing}; the engine has {sorted(self.proposers)}")
        self.clock = clock
        self.tail = TailBudget(tail_hook, config.tail_budget, config.tail_credit_cap_s, clock)
        self.eos_ids = tuple(eos_ids)
        bad = [i for i in config.capture_layers if not 0 <= i < model.args.n_layers]
        if bad:
            raise ValueError(f"capture_layers {bad} outside the model's {model.args.n_layers} layers")
        w = model.head_weight
        self.device, self.dtype = w.device, w.dtype
        # KV headroom: a verify writes up to max_nodes columns past a row's length (the widest arm of the controller)
        self.max_nodes = max([self.spec.num_nodes, 1, *(a.verify_tokens for a in arms)])
        self.max_len = config.max_len
        t = round_up(config.max_len + self.max_nodes + 2, 64)  # headroom: a verify writes up to max_nodes columns
        slots = config.max_slots or slots_for_budget(model.args, t, config.kv_cache_gb, self.dtype)
        self.cache = KVCache.allocate(model.args, slots, t, self.device, self.dtype)
        if model.rope_cos.shape[0] < t:
            model.init_rope(self.device, t)
        self.rows = RowState(slots, t, config.max_len, self.max_nodes + 1, self.device)
        self.gen = torch.Generator(device=self.device).manual_seed(config.seed)
        self._cols = torch.arange(t, device=self.device)
        on_cuda = self.device.type == "cuda"
        fused = resolve_fused(config.fused_kernels, model.args, self.device, self.dtype)
        self.step = DecodeStep(model, self.cache, self.rows, self.gen,
                               compile_max_batch=config.compile_max_batch if config.compile and on_cuda else 0,
                               compile_mode=config.compile_mode, capture_layers=config.capture_layers, fused=fused,
                               fused_max_seqs=config.fused_max_seqs)
        # one memory pool for every graph of this engine (the verify graphs share it); set by attach_graphs on CUDA
        self.graph_pool: object | None = None
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # small prefill chunks (rollout/prefill_graphs.py)
        memory.attach_graphs(self)  # restore_memory() attaches fresh ones the same way
        # host mirrors of the rows 0..n_active-1
        self.n_active = 0
        self.row_seq: list[tuple[int, int]] = []  # (request, sample) per active row
        self.row_params: list[tuple[float, float, int]] = []  # (temperature, top_p, top_k) per active row
        self._row_hi = np.zeros(slots, dtype=np.int64)  # upper bound of lens per row (see `row_hi`)
        self._plain_steps = 0  # plain decode steps not yet added to _row_hi
        # plain steps' (roots [B], hidden [B, H], emitted [B], batch) awaiting the hidden-state hook (`_flush_hidden`)
        self._pending_hidden: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        self._hi_max: int | None = None  # max of _row_hi over the active rows (None: recompute)
        self._mode: Mode = GREEDY  # sampling mode of rows 0..n-1 (rollout/decode_step.py)
        self.row_cap = np.zeros(slots, dtype=np.int64)  # prompt_len + max_new_tokens per row
        self.row_known = np.zeros(slots, dtype=np.int64)  # emitted tokens already appended to `histories`
        self.row_plen = np.zeros(slots, dtype=np.int64)  # prompt length per row (host mirror of rows.prompt_len)
        self._hist_fresh = False  # histories hold every emitted token of rows 0..n-1 (no device read needed)
        self._done_host: list[int] | None = None  # done flags (0/1) of rows 0..n-1 read by the last speculative step
        self._rows_version = next(_ROWS_VERSIONS)  # new whenever rows 0..n-1 change (prefill, sync, a new generate)
        # speculative.draft_context's cache: (key, context, its histories)
        self._spec_ctx: tuple[tuple[int, ...], DraftContext, list[list[int]]] | None = None
        self._hook_stage = HostStage(self.device)  # a speculative step's hook rows index: one upload per step
        self._hook_flat: tuple[torch.Tensor, torch.Tensor] | None = None  # (hidden, its [B*K, F] view)
        # request -> per-sample host token lists (prompt + emitted), what drafters read; filled lazily
        self.histories: dict[int, list[list[int]]] = {}
        self.accept_stats = AcceptanceStats()  # speculative steps of the last generate() (spec/stats.py)

    @property
    def slots(self) -> int:
        return self.rows.slots  # the cache's rows (also while it is released)

    # ------------------------------------------------------------------------------------------------- memory
    @property
    def released(self) -> bool:
        """True between release_memory() and restore_memory()."""
        return memory.kv_released(self.cache)

    def release_memory(self) -> int:
        """Free the KV cache and every CUDA graph that reads it, between generate() calls -> bytes freed (the cache,
        drafter caches, the graphs' pool growth). Idempotent (0 the second time)."""
        return memory.release(self)

    def restore_memory(self) -> None:
        """Allocate the cache again (same shapes); graphs are captured again on first use. Idempotent."""
        memory.restore(self)

    def _require_memory(self) -> None:
        if self.released:
            raise RuntimeError("the engine's KV cache is released (Engine.release_memory); call restore_memory() "
                               "before generating")

    @property
    def row_hi(self) -> np.ndarray:
        """Upper bound of lens per row (picks the attention length), capped at prompt + max_new_tokens. Plain decode
        steps only count themselves; this brings the array up to date, and since callers may write into it, the
        cached maximum is recomputed at the next step."""
        if self._plain_steps:
            n = self.n_active
            self._row_hi[:n] = np.minimum(self._row_hi[:n] + self._plain_steps, self.row_cap[:n])
            self._plain_steps = 0
        self._hi_max = None
        return self._row_hi

    def _active_hi(self) -> int:
        """max(row_hi) over the active rows, without touching the array while only plain steps run."""
        if self._hi_max is None:
            hi = self.row_hi  # folds the pending steps in (and drops the cached maximum, set right below)
            self._hi_max = int(hi[: self.n_active].max()) if self.n_active else 0
        return self._hi_max + self._plain_steps

    def _rows_changed(self) -> None:
        """After prefill / sync: recompute what plain steps cache (sampling mode, attention bound); speculative steps
        build a new DraftContext."""
        self._rows_version = next(_ROWS_VERSIONS)
        self._mode = sampling_mode(self.row_params) if self.row_params else GREEDY
        _ = self.row_hi  # folds pending steps in and drops the cached maximum

    def warmup(self, max_batch: int, max_len: int, batches: Sequence[int] | None = None,
               params: SamplingParams | None = None) -> float:
        """Capture the decode graphs for every (batch bucket <= max_batch, attention bucket <= max_len) ahead of a
        timed run, for requests sampled with `params` (default SamplingParams(): temperature 1, no filter) (CUDA with
        graphs only; a no-op otherwise); `batches` limits it to those batch sizes' buckets. Returns the seconds
        spent. Nothing is executed beyond the captures' warm-up runs, whose effects are undone."""
        self._require_memory()
        if self.graphs is None or self.n_active:
            return 0.0
        p = params or SamplingParams()
        mode = sampling_mode([(float(p.temperature), float(p.top_p), int(p.top_k))])
        t0 = time.perf_counter()
        wanted = batches if batches is not None else [b for b in self.config.batch_buckets if b <= max_batch]
        buckets = sorted({self.bucket(b) for b in [*wanted, max_batch]})
        his = [*range(1, max_len + 2, self.config.attn_bucket), max_len + 1]  # decode attends up to lens + 1
        with torch.no_grad():
            for b in buckets:
                for tk in sorted({self._decode_tk(b, hi) for hi in his}):
                    self.graphs.capture(b, tk, mode)
            if self.verify_graphs is not None:
                self._warmup_verify(max_batch, mode)
            self._warmup_drafts(max_batch, mode)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def _warmup_verify(self, max_batch: int, mode: Mode) -> None:
        """Capture the verify graphs of every SD shape this engine can run, per batch bucket: the controller's arms of
        the batches in that bucket, up to the batch at which its switch turns SD off again, or the fixed SpecConfig
        at every batch. Learned drafters send their q (sampled modes), the n-gram drafter does not."""
        assert self.verify_graphs is not None
        plan: dict[int, set[tuple[int, int, int, bool]]] = {}
        if self.adaptive is not None:
            for n, a in self._sd_arms(max_batch):
                plan.setdefault(self.bucket(n), set()).add((a.verify_tokens, a.depth, a.topk, a.drafter != "ngram"))
        elif self.proposer is not None and self.spec.mode == "on" and (topk := proposer_topk(self.proposer)):
            q = not isinstance(self.proposer, NGramProposer)
            for n in range(1, max_batch + 1):
                plan.setdefault(self.bucket(n), set()).add((self.spec.num_nodes, self.spec.depth, topk, q))
        if any(plan.values()):
            self.verify_graphs.warmup(self, {b: sorted(shapes) for b, shapes in plan.items()}, mode)

    def _sd_arms(self, max_batch: int) -> list[tuple[int, Arm]]:
        """(batch, arm) of every SD arm the controller can plan, for batches up to the one at which its switch turns
        SD off again (what the warm-ups capture)."""
        assert self.adaptive is not None
        top = min(max_batch, self.adaptive.switch.config.off_threshold)
        return [(n, a) for n in range(1, top + 1) for a in self.adaptive.arms_for(n) if a.is_sd]

    def _warmup_drafts(self, max_batch: int, mode: Mode) -> None:
        """Capture the chain-draft graphs the SD arms will replay, in drafters that keep them
        (EagleProposer.capture_chain: per batch bucket, depth and sampling filters), so that a drafter's first use of a
        shape in a later rollout does not capture inside it. Mixed per-row settings: the filters are the rows' (seen
        only at draft time)."""
        if mode[0] == "mixed":
            return
        filters = row_filters([mode[1:]]) if mode[0] == "uniform" else (0, False, -1.0)  # greedy rows: no filter
        plan: dict[int, tuple[Proposer, dict[int, set[int]]]] = {}  # id(proposer) -> (proposer, depth -> batches)

        def want(prop: Proposer | None, depth: int, n: int) -> None:
            if prop is not None and hasattr(prop, "capture_chain") and depth > 0:
                plan.setdefault(id(prop), (prop, {}))[1].setdefault(depth, set()).add(n)

        if self.adaptive is not None:
            for n, a in self._sd_arms(max_batch):
                if a.topk == 1:  # the proposer drafts min(depth, verify budget - 1) tokens
                    want(self.proposers.get(a.drafter), min(a.depth, a.verify_tokens - 1), n)
        elif self.spec.mode == "on" and self.spec.method == "chain":
            for n in range(1, max_batch + 1):
                want(self.proposer, min(self.spec.depth, self.spec.num_nodes - 1), n)
        for prop, by_depth in plan.values():
            for depth, batches in sorted(by_depth.items()):
                prop.capture_chain(sorted(batches), depth, filters)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------------------------------ helpers
    def _decode_tk(self, batch: int, hi: int) -> int:
        """Attention length of a plain decode step: bucketed, or the full cache for compiled batches."""
        if self.step.compiled(batch):  # one shape per batch bucket: compiled once
            return self.cache.max_len
        return self._tk_of(hi)

    @property
    def hook_layers(self) -> tuple[int, ...]:
        """Layers an eager forward captures for the hook: EngineConfig.capture_layers while a hook is attached."""
        return self.config.capture_layers if self.hidden_hook is not None else ()

    def _tk_of(self, hi: int) -> int:
        return min(round_up(max(hi, 1), self.config.attn_bucket), self.cache.max_len)

    def bucket(self, n: int) -> int:
        for b in self.config.batch_buckets:
            if b >= n:
                return min(b, self.slots)
        return self.slots

    def _tk(self, n_rows: int, extra: int) -> int:
        return self._tk_of(int(self.row_hi[:n_rows].max()) + extra if n_rows else extra)

    def _params(self, rows: slice) -> tuple[object, object, object]:
        """Scalars when every active row shares one setting (cheaper processing), else per-row tensors."""
        if self._mode[0] == "uniform":
            return self._mode[1:]
        return self.rows.temp[rows], self.rows.top_p[rows], self.rows.top_k[rows]

    def _all_greedy(self) -> bool:
        return self._mode == GREEDY

    # ------------------------------------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, items: list[tuple[int, int]], requests: Sequence[Request]) -> StepStats:
        """Admit `items` ((request, sample) pairs) into rows n_active.. ; one forward per distinct prompt
        (rollout/prefill.py)."""
        return prefill(self, items, requests)

    # ------------------------------------------------------------------------------------------------- decode
    @torch.no_grad()
    def decode_step(self, batch: int) -> torch.Tensor:
        """One plain decode step for rows 0..batch-1 (no host sync) -> tokens emitted per row [B] (device; a graph's
        static output on CUDA: consume it before the next step, as `.sum()` right away does)."""
        tk = self._decode_tk(batch, self._active_hi() + 1)
        out: StepOut = self.graphs.run(batch, tk, self._mode) if self.graphs is not None else self.step(batch, tk,
                                                                                                        self._mode)
        self._hist_fresh, self._done_host = False, None
        if self.hidden_hook is not None:  # stashed, emitted once per window at sync(): no host read per step
            if self._pending_hidden and self._pending_hidden[0][3] != batch:
                self._flush_hidden()
            # clones: a graph's outputs are overwritten by the next replay
            self._pending_hidden.append((out.roots.clone(), out.hidden.clone(), out.n.clone(), batch))
        self._plain_steps += 1
        return out.n

    # -------------------------------------------------------------------------------------------- speculative
    def speculative_step(self, batch: int, arm: Arm | None = None) -> StepStats:
        """Draft with `arm`'s drafter and shape (None: the fixed proposer and SpecConfig), verify all rows in one
        target forward, accept, roll back, commit; one host read at the end (rollout/speculative.py)."""
        if torch.is_grad_enabled():  # a direct call (generate() already runs without; a decorator costs ~10 us)
            with torch.no_grad():
                return self.speculative_step(batch, arm)
        self._flush_hidden()  # the drafter sees every earlier token's hidden state before it drafts
        return speculative_step(self, batch, arm)

    def _sync_histories(self, n: int) -> None:
        """Append the tokens emitted since the last call to the host histories of rows 0..n-1 (one copy)."""
        n_gen = self.rows.n_gen[:n].cpu().numpy()
        known = self.row_known[:n]
        lo, hi = int(known.min()), int(n_gen.max())
        self._hist_fresh = n == self.n_active
        if hi <= lo:
            return
        block = self.rows.out_tok[:n, lo:hi].cpu().tolist()
        for b, (r, s) in enumerate(self.row_seq[:n]):
            self.histories[r][s].extend(block[b][known[b] - lo : n_gen[b] - lo])
        self.row_known[:n] = n_gen

    def _flush_hidden(self) -> None:
        """Hand the stashed plain steps' hidden states to the hook: one [B, W] block per window, in token order (a
        row emits 1 token per step until it finishes, then 0, so its kept entries are a prefix)."""
        if self._pending_hidden:
            pend, self._pending_hidden = self._pending_hidden, []
            n = torch.stack([p[2] for p in pend], 1)  # [B, W]
            self._emit_hidden(pend[0][3], torch.stack([p[0] for p in pend], 1), torch.stack([p[1] for p in pend], 1),
                              n.sum(1))

    def _emit_hidden(self, batch: int, toks: torch.Tensor, hidden: torch.Tensor, n_kept: torch.Tensor,
                     n_host: list[int] | None = None) -> None:
        """toks [B', K], hidden [B', K', H or (k+1)H], n_kept [B]: the first n_kept[b] entries of rows b < batch (at
        most min(K, K')) go to the hook (rows past the batch, a graph's padding, are never read). n_host: the same
        counts already read to the host (a speculative step's one read): the rows are then picked with a host-built
        index of both tensors, one upload, no further device sync (a boolean mask costs three) and no view of the
        inputs (a graph's static outputs: their flat view is kept); the hook's seq ids carry their runs
        (drafter/buffer.SeqIds)."""
        assert self.hidden_hook is not None
        rows = min(batch, self.n_active)
        if n_host is None:
            keep = self._cols[: toks.shape[1]][None, :] < n_kept[:, None]
            counts = keep.sum(1).tolist()
            seq = [self.row_seq[b] for b in range(rows) for _ in range(counts[b])]
            self.hidden_hook(seq, toks[keep], hidden[keep])
            return
        kt, kh = toks.shape[1], hidden.shape[1]
        k = min(kt, kh)
        at_t: list[int] = []  # flat index of each kept entry in toks (Python: ~16 entries)
        runs, seq = [], []
        for b, (sid, c) in enumerate(zip(self.row_seq[:rows], n_host[:rows], strict=True)):
            if c:
                c = min(c, k)
                at_t += range(b * kt, b * kt + c)
                runs.append((sid, c))
                seq += [sid] * c
        if kh == kt:  # the same flat index in both (a chain verified at its own width)
            it = ih = self._hook_stage.put(at_t)[0]
        else:
            it, ih = self._hook_stage.put(at_t, [i // kt * kh + i % kt for i in at_t])
        kept = self._hook_flat
        flat = kept[1] if kept is not None and kept[0] is hidden else hidden.flatten(0, 1)
        if hidden.is_contiguous():  # a view: still this tensor's rows at the next step (a copy would not be)
            self._hook_flat = (hidden, flat)
        key = (self._rows_version, rows) if len(runs) == rows else None  # every row: its sequences are row_seq's
        self.hidden_hook(SeqIds(runs, seq, key), torch.take(toks, it), flat.index_select(0, ih))

    # --------------------------------------------------------------------------------------------------- sync
    def sync(self, results: dict[tuple[int, int], SequenceResult], on_finish: FinishCallback | None = None) -> None:
        """Finished rows leave (results copied to the host, then `on_finish(result)` for each, in row order); the rest
        are compacted into rows 0..n-1."""
        self._flush_hidden()  # before rows move: the stash is indexed by row
        n = self.n_active
        if n == 0:
            return
        st = self.rows
        done, self._done_host = self._done_host or st.done[:n].cpu().tolist(), None
        fin = [i for i in range(n) if done[i]]
        if not fin:
            return
        fin_t = torch.tensor(fin, device=self.device)
        counts = st.n_gen.index_select(0, fin_t).cpu().tolist()
        width = max(counts)
        toks = st.out_tok.index_select(0, fin_t)[:, :width].cpu().tolist()
        lps = st.out_lp.index_select(0, fin_t)[:, :width].cpu().tolist()
        eos_rows = st.eos.index_select(0, fin_t).cpu().tolist()
        finished: list[SequenceResult] = []
        for i, row in enumerate(fin):
            r, s = self.row_seq[row]
            tk = toks[i][: counts[i]]
            reason = "stop" if tk and tk[-1] in eos_rows[i] else "length"
            finished.append(SequenceResult(r, s, tk, lps[i][: counts[i]], reason))  # type: ignore[arg-type]
            results[(r, s)] = finished[-1]
        keep = [i for i in range(n) if not done[i]]
        n_new = len(keep)
        holes = [i for i in range(n_new) if done[i]]
        movers = [i for i in keep if i >= n_new]
        if holes:
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            self.cache.move_rows(src, dst)
            st.move_rows(src, dst)
            hi = self.row_hi
            for h, mv in zip(holes, movers, strict=True):
                self.row_seq[h], self.row_params[h] = self.row_seq[mv], self.row_params[mv]
                hi[h], self.row_cap[h] = hi[mv], self.row_cap[mv]
                self.row_known[h], self.row_plen[h] = self.row_known[mv], self.row_plen[mv]
        st.done[n_new:n] = True
        del self.row_seq[n_new:], self.row_params[n_new:]
        self.n_active = n_new
        self._rows_changed()
        if on_finish is not None:
            for res in finished:
                on_finish(res)

    # ----------------------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, requests: Sequence[Request], on_finish: FinishCallback | None = None) -> GenerationOutput:
        """Run `requests` to completion; `on_finish(result)` is called once per sequence as soon as it leaves the
        batch (from `sync()`, before this returns; e.g. to compute rewards while the tail still decodes)."""
        self._require_memory()
        t_start = time.perf_counter()
        for i, req in enumerate(requests):
            if not req.prompt:
                raise ValueError(f"request {i} has an empty prompt")
            if len(req.prompt) + req.params.max_new_tokens > self.max_len:
                raise ValueError(f"request {i}: prompt {len(req.prompt)} + max_new_tokens "
                                 f"{req.params.max_new_tokens} > EngineConfig.max_len {self.max_len}")
        queue = deque((r, s) for r, req in enumerate(requests) for s in range(req.params.n))
        results: dict[tuple[int, int], SequenceResult] = {}
        steps: list[StepStats] = []
        ctl = self.adaptive
        use_spec = ctl is None and self.spec.mode == "on" and self.proposer is not None
        self.histories = {r: [list(req.prompt) for _ in range(req.params.n)] for r, req in enumerate(requests)}
        self._rows_version = next(_ROWS_VERSIONS)  # new token lists: contexts built on the old ones are stale
        self.accept_stats = AcceptanceStats()
        self.tail.reset()
        self._done_host = None
        if ctl is not None:
            ctl.start_rollout()
        pending: Pending | None = None
        windows = PlainWindows(self)
        while queue or self.n_active:
            if queue and self.n_active < self.slots:
                items = [queue.popleft() for _ in range(min(self.slots - self.n_active, len(queue)))]
                steps.append(self.prefill(items, requests))
            if ctl is not None:
                pending = adaptive_iteration(self, ctl, steps, pending, self.tail)
            elif use_spec:
                steps.append(self.speculative_step(self.n_active))
            elif not windows.step(steps):  # plain decoding, one window ahead of its reads (rollout/windows.py)
                continue
            self.sync(results, on_finish)
        windows.drain(steps)
        for p in {id(x): x for x in [self.proposer, *self.proposers.values()] if x is not None}.values():
            p.reset()
        seqs = [results[k] for k in sorted(results)]
        out = GenerationOutput(seqs, steps, time.perf_counter() - t_start)
        if ctl is not None:
            out.sd_metrics = ctl.metrics.summary()
            if self.tail.hook is not None:
                out.sd_metrics.update({"perf/tail_hook_s": self.tail.used_s, "perf/tail_hook_calls": self.tail.calls})
            out.sd_buckets = ctl.metrics.per_bucket()
        return out

