"""The rollout engine: continuous batching over a ragged KV cache, plain and speculative decoding, exact sampling.

    engine = Engine(model, eos_ids=tok.eos_ids, config=EngineConfig(max_len=1024, max_slots=64))
    out = engine.generate([Request(prompt_ids, RequestSampling(temperature=1.0, max_new_tokens=256, n=8))])
    out.sequences[i].tokens / .logprobs / .finish_reason;  out.steps: per-step StepStats

Phases (gpt-fast style; `generate()` only orchestrates; each phase module takes the engine's `EngineState`,
rollout/engine_state.py, and none imports the engine):
- `prefill(items)`: prompts of newly admitted sequences (one forward per distinct prompt, K/V copied to its
  siblings; small chunks replayed from CUDA graphs, rollout/prefill_graphs.py), first token sampled;
- `decode_step(batch)`: one token for rows 0..batch-1, no host sync: the whole step (forward, processing, sampling
  with each row's own random stream, log-probs, commit; rollout/decode_step.py) is one CUDA-graph replay on CUDA
  (rollout/graphs.py; torch.compile'd before capture for small batches with `EngineConfig.compile`), the same body
  run eagerly elsewhere; same seed => same tokens either way; generate() runs windows of `sync_every` steps with
  one host read each, on CUDA one window ahead of the reads (rollout/windows.py), with a controller too;
- `speculative_step(batch, arm)`: the arm's proposer drafts a chain or tree per row, ONE target forward verifies all
  rows with the tree mask, speculative/verify/verifier.py accepts per row, the KV cache keeps only accepted nodes, EOS /
  max_new_tokens cut inside accepted runs; ONE host read at the end (emitted counts, done flags, per-position
  acceptance and the emitted tokens, which extend the host histories directly) (rollout/speculative_step.py);
- `sync()`: finished sequences leave (results copied out, `generate(..., on_finish=cb)` calls cb(result) for each
  right then), rows are compacted so active sequences stay in rows 0..n-1, and waiting requests join in the freed
  rows.
Speculative decoding: `Engine(..., controller=ctl, proposers={"ngram": ..., "eagle": ...})` asks the controller
(an `SdController`, rollout/controller_protocol.py; speculative/control/controller.py's `AdaptiveSd` in practice) for an arm every decode
step and runs plain decoding or a speculative step with that arm's drafter, depth, top-k and verify width
(rollout/adaptive_loop.py); SD switches on and off mid-generation without re-prefilling, and stays exactly lossless
(the verifier is the same for every arm). Fixed SD is a controller with one arm (`AdaptiveSd.fixed(arm)`); without
a controller the engine decodes plainly. The KV headroom is sized at construction for the widest arm.
`GenerationOutput.sd_metrics` carries the controller's metrics summary;
`tail_hook(budget_s)` runs between tail steps within a bounded credit.
Randomness is per sequence (decoding/streams.py): every draw a sequence makes (its sampled token, a speculative step's
acceptance uniforms and last token, a sampling drafter's drafts) is a counter-based hash of its stream key and the
index of the emitted token it decides, the key from its request's seed and its sample index (GRPO siblings differ).
So a sequence's tokens do not depend on the batch it shares, on the path (eager, CUDA graph, fused kernels) or on
preemption (it continues exactly as it would have). A request's seed is `RequestSampling.seed`, else derived from one
base seed per generate() drawn from the engine's torch.Generator (EngineConfig.seed; `Engine.gen`, what checkpoints
save): same engine seed and requests, same tokens. Sampling and acceptance use the processed
distribution of decoding/sampling.py; log-probs are of emitted tokens under it (greedy rows: log_softmax of the
logits). Hidden-state capture: `hidden_hook(seq_ids, token_ids, hidden [N, H])` is called with the final-norm hidden
state at every position whose K/V entered the cache (rollout/hidden_rows.py); with `EngineConfig.capture_layers`
(EAGLE-3: (2, L//2, L-3)) the hook gets cat(hidden entering each of those layers, final-norm hidden) [N, (k+1)H]
from the same forwards; the decode and verify graphs then output that width.
KV layout (decoding/kv_cache.py): rows of max_len columns per sequence by default; with `EngineConfig.page_size`
pages handed out as sequences grow, admission by free pages and preemption of the youngest sequence when they run
out (swapped to host memory and back, bit for bit: rollout/paging.py); `Engine.preemptions` counts the last
generate()'s.
Memory: `release_memory()` frees the KV cache and every graph that reads it while the engine is idle (the policy
update), `restore_memory()` allocates it again; generate() refuses to run in between (rollout/memory.py).
Run the tests: `python -m pytest tests/engine -q`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch

from worker.tlt.decoding.kv_cache import KVCache
from worker.tlt.decoding.row_state import RowState
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout import memory, paging
from worker.tlt.rollout.adaptive_loop import AdaptiveLoop, TailBudget, TailHook
from worker.tlt.rollout.controller_protocol import SdController
from worker.tlt.rollout.decode_step import MIXED, DecodeStep, Mode, StepOut, sampling_mode
from worker.tlt.rollout.engine_state import EngineState, HiddenHook
from worker.tlt.rollout.graphs import DecodeGraphs
from worker.tlt.rollout.hidden_rows import flush_hidden, stash_plain_step
from worker.tlt.rollout.prefill import prefill
from worker.tlt.rollout.prefill_graphs import PrefillGraphs
from worker.tlt.rollout.speculative_graphs import VerifyGraphs
from worker.tlt.rollout.speculative_step import row_filters, speculative_step, warmup_context
from worker.tlt.rollout.types import (
    EngineConfig,
    GenerationOutput,
    Request,
    RequestSampling,
    SequenceResult,
    StepStats,
)
from worker.tlt.rollout.windows import PlainWindows
from worker.tlt.speculative.arm import Arm
from worker.tlt.speculative.proposers.protocol import Proposer
from worker.tlt.speculative.verify.accept_stats import AcceptanceStats

FinishCallback = Callable[[SequenceResult], None]  # called once per sequence as it leaves the batch


def _verify_width(arms: Sequence[Arm]) -> int:
    """The most tokens a verify of these arms writes past a row's length (1: plain decoding)."""
    return max([1, *(a.verify_tokens for a in arms)])


class Engine:
    def __init__(
        self,
        model: Transformer,
        *,
        eos_ids: Sequence[int],
        config: EngineConfig | None = None,
        hidden_hook: HiddenHook | None = None,
        controller: SdController | None = None,
        proposers: Mapping[str, Proposer] | None = None,
        tail_hook: TailHook | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """controller: plans every step (None: plain decoding); proposers: drafter kind -> Proposer, one for each
        drafter its arms name; tail_hook: called with a time budget between steps run with the switch on; clock:
        step timing (tests pass a deterministic one so that the bandit's choices are reproducible)."""
        config = config or EngineConfig()
        self.model = model.eval()
        self.config = config
        self.controller = controller
        self.proposers: dict[str, Proposer] = dict(proposers or {})
        arms = controller.all_arms() if controller is not None else []
        self._check_drafters(arms)
        self.tail = TailBudget(tail_hook, config.tail_budget, config.tail_credit_cap_s, clock)
        # KV headroom: a verify writes up to max_nodes columns past a row's length (the widest arm of the controller)
        self.state = EngineState(model, config, eos_ids, _verify_width(arms), hidden_hook, clock)
        self.graph_set = memory.new_graphs(self.state)  # restore_memory() attaches fresh ones the same way
        self.preemptions = 0  # sequences the last generate() preempted (paged layout: rollout/paging.py)

    # ------------------------------------------------------------------------------------ state, as callers see it
    @property
    def rows(self) -> RowState:
        return self.state.rows

    @property
    def cache(self) -> KVCache:
        return self.state.cache

    @property
    def gen(self) -> torch.Generator:
        return self.state.gen

    @property
    def step(self) -> DecodeStep:  # the decode body and the cached forward
        return self.state.step

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def n_active(self) -> int:
        return self.state.n_active

    @property
    def slots(self) -> int:
        return self.state.slots

    @property
    def max_nodes(self) -> int:
        return self.state.max_nodes

    @property
    def histories(self) -> dict[int, list[list[int]]]:
        return self.state.histories

    @property
    def accept_stats(self) -> AcceptanceStats:  # the speculative steps of the last generate()
        return self.state.accept_stats

    @property
    def hidden_hook(self) -> HiddenHook | None:
        return self.state.hidden_hook

    @hidden_hook.setter
    def hidden_hook(self, hook: HiddenHook | None) -> None:
        self.state.hidden_hook = hook

    @property
    def graph_pool(self) -> object | None:
        return self.graph_set.pool  # one memory pool for every graph of this engine

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.graph_set.decode

    @property
    def verify_graphs(self) -> VerifyGraphs | None:
        return self.graph_set.verify

    @property
    def prefill_graphs(self) -> PrefillGraphs | None:  # small prefill chunks (rollout/prefill_graphs.py)
        return self.graph_set.prefill

    # ------------------------------------------------------------------------------------------------- memory
    @property
    def released(self) -> bool:
        """True between release_memory() and restore_memory()."""
        return memory.kv_released(self.state.cache)

    def release_memory(self) -> int:
        """Free the KV cache and every CUDA graph that reads it, between generate() calls -> bytes freed (the cache,
        drafter caches, the graphs' pool growth). Idempotent (0 the second time)."""
        freed = memory.release(self.state, self.graph_set, self.proposers.values())
        if self.released:
            self.graph_set = memory.EngineGraphs()
        return freed

    def restore_memory(self) -> None:
        """Allocate the cache again (same shapes); graphs are captured again on first use. Idempotent."""
        if memory.restore(self.state):
            self.graph_set = memory.new_graphs(self.state)

    def _require_memory(self) -> None:
        if self.released:
            raise RuntimeError("the engine's KV cache is released (Engine.release_memory); call restore_memory() "
                               "before generating")

    # ------------------------------------------------------------------------------------------------ warm-up
    def warmup(self, max_batch: int, max_len: int, batches: Sequence[int] | None = None,
               params: RequestSampling | None = None) -> float:
        """Capture the decode graphs for every (batch bucket <= max_batch, attention bucket <= max_len) ahead of a
        timed run, for requests sampled with `params` (default RequestSampling(): temperature 1, no filter) (CUDA
        with graphs only; a no-op otherwise); `batches` limits it to those batch sizes' buckets; then the verify
        graphs and the drafters' graphs of every arm the controller can plan. Returns the seconds spent. Nothing is
        executed beyond the captures' warm-up runs, whose effects are undone."""
        self._require_memory()
        s = self.state
        if self.graphs is None or s.n_active:
            return 0.0
        rows = [params or RequestSampling()]
        mode = sampling_mode(rows)
        t0 = time.perf_counter()
        wanted = batches if batches is not None else [b for b in self.config.batch_buckets if b <= max_batch]
        buckets = sorted({s.bucket(b) for b in [*wanted, max_batch]})
        his = [*range(1, max_len + 2, self.config.attn_bucket), max_len + 1]  # decode attends up to lens + 1
        with torch.no_grad():
            for b in buckets:
                for tk in sorted({s.decode_tk(b, hi) for hi in his}):
                    self.graphs.capture(b, tk, mode)
            if self.verify_graphs is not None:
                self._warmup_verify(max_batch, mode)
            self._warmup_drafts(max_batch, rows)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def _warmup_verify(self, max_batch: int, mode: Mode) -> None:
        """Capture the verify graphs of every SD shape this engine can run, per batch bucket: the controller's arms of
        the batches in that bucket, up to the batch at which its switch turns SD off again. Learned drafters' chains
        send their q (sampled modes); trees and the n-gram drafter do not (Arm.drafts_with_q)."""
        assert self.verify_graphs is not None
        plan: dict[int, set[tuple[int, int, int, bool]]] = {}
        for n, a in self._sd_arms(max_batch):
            plan.setdefault(self.state.bucket(n), set()).add((a.verify_tokens, a.depth, a.topk, a.drafts_with_q))
        if any(plan.values()):
            self.verify_graphs.warmup(self.state, {b: sorted(shapes) for b, shapes in plan.items()}, mode)

    def _sd_arms(self, max_batch: int) -> list[tuple[int, Arm]]:
        """(batch, arm) of every SD arm the controller can plan, for batches up to the one at which its switch turns
        SD off again (what the warm-ups capture)."""
        ctl = self.controller
        if ctl is None:
            return []
        top = max_batch if ctl.switch.config.mode == "on" else min(max_batch, ctl.switch.config.off_threshold)
        return [(n, a) for n in range(1, top + 1) for a in ctl.arms_for(n) if a.is_sd]

    def _warmup_drafts(self, max_batch: int, rows: Sequence[RequestSampling]) -> None:
        """Have the drafters capture the chain-draft graphs the SD arms will replay (`Proposer.capture`: per batch,
        depth and sampling filters), so that a drafter's first use of a shape in a later rollout does not capture
        inside it; the filters are those of rows sampled with `rows`' settings. Mixed per-row settings: nothing (the
        filters are the rows' own, seen only at draft time)."""
        if sampling_mode(rows) == MIXED:
            return
        filters = row_filters(rows)  # what draft_context computes for these rows
        plan: dict[str, dict[int, set[int]]] = {}  # drafter -> depth -> batches
        trees: dict[str, set[tuple[int, int, int, int]]] = {}  # drafter -> (batch bucket, topk, depth, nodes)
        for n, a in self._sd_arms(max_batch):
            depth = min(a.depth, a.verify_tokens - 1)  # the proposer drafts min(depth, verify budget - 1) tokens
            if a.topk == 1 and depth > 0:
                plan.setdefault(a.drafter, {}).setdefault(depth, set()).add(n)
            elif a.topk > 1:
                trees.setdefault(a.drafter, set()).add((self.state.bucket(n), a.topk, a.depth, a.verify_tokens))
        for drafter, by_depth in plan.items():
            for depth, batches in sorted(by_depth.items()):
                self.proposers[drafter].capture(sorted(batches), depth, filters)
        for drafter, shapes in trees.items():  # eager drafts: their first use compiles kernels (~1.7 s at a 7B width)
            proposer = self.proposers[drafter]
            for batch, topk, depth, nodes in sorted(shapes):
                proposer.propose(warmup_context(batch, topk, depth, nodes, rows[0], filters, self.state.device))
            proposer.reset()  # forget the warm-up rows

    # ------------------------------------------------------------------------------------------------- phases
    @torch.no_grad()
    def prefill(self, items: list[tuple[int, int]], requests: Sequence[Request]) -> StepStats:
        """Admit `items` ((request, sample) pairs) into rows n_active.. ; one forward per distinct prompt
        (rollout/prefill.py). A direct call (outside generate()) seeds `requests` first, as generate() does."""
        self.state.begin_generate([r.params for r in requests])
        return self._prefill(items, requests)

    def _prefill(self, items: list[tuple[int, int]], requests: Sequence[Request]) -> StepStats:
        return prefill(self.state, items, requests, self.graph_set.prefill)

    @torch.no_grad()
    def decode_step(self, batch: int) -> torch.Tensor:
        """One plain decode step for rows 0..batch-1 (no host sync) -> tokens emitted per row [B] (device; a graph's
        static output on CUDA: consume it before the next step, as `.sum()` right away does)."""
        s = self.state
        tk = s.decode_tk(batch, s.active_hi() + 1)
        out: StepOut = self.graphs.run(batch, tk, s.mode) if self.graphs is not None else s.step(batch, tk, s.mode)
        s.hist_fresh, s.done_host = False, None
        if s.hidden_hook is not None:  # stashed, emitted once per window at sync(): no host read per step
            stash_plain_step(s, out.roots, out.hidden, out.n, batch)
        s.plain_steps += 1
        return out.n

    def speculative_step(self, batch: int, arm: Arm) -> StepStats:
        """Draft with `arm`'s drafter and shape, verify all rows in one target forward, accept, roll back, commit;
        one host read at the end (rollout/speculative_step.py)."""
        if torch.is_grad_enabled():  # a direct call (generate() already runs without; a decorator costs ~10 us)
            with torch.no_grad():
                return self.speculative_step(batch, arm)
        proposer = self.proposers.get(arm.drafter)
        if proposer is None:
            raise RuntimeError(f"arm {arm.name} drafts with {arm.drafter!r}; the engine has {sorted(self.proposers)}")
        flush_hidden(self.state)  # the drafter sees every earlier token's hidden state before it drafts
        return speculative_step(self.state, batch, arm, proposer, self.verify_graphs)

    def sync(self, results: dict[tuple[int, int], SequenceResult], on_finish: FinishCallback | None = None) -> None:
        """Finished rows leave (results copied to the host, then `on_finish(result)` for each, in row order); the rest
        are compacted into rows 0..n-1."""
        s = self.state
        flush_hidden(s)  # before rows move: the stash is indexed by row
        n = s.n_active
        if n == 0:
            return
        st = s.rows
        done, s.done_host = s.done_host or st.done[:n].cpu().tolist(), None
        fin = [i for i in range(n) if done[i]]
        if not fin:
            return
        fin_t = torch.tensor(fin, device=s.device)
        counts = st.n_gen.index_select(0, fin_t).cpu().tolist()
        width = max(counts)
        toks = st.out_tok.index_select(0, fin_t)[:, :width].cpu().tolist()
        lps = st.out_lp.index_select(0, fin_t)[:, :width].cpu().tolist()
        eos_rows = st.eos.index_select(0, fin_t).cpu().tolist()
        finished: list[SequenceResult] = []
        for i, row in enumerate(fin):
            r, smp = s.row_seq[row]
            tk = toks[i][: counts[i]]
            reason = "stop" if tk and tk[-1] in eos_rows[i] else "length"
            finished.append(SequenceResult(r, smp, tk, lps[i][: counts[i]], reason))  # type: ignore[arg-type]
            results[(r, smp)] = finished[-1]
        keep = [i for i in range(n) if not done[i]]
        n_new = len(keep)
        holes = [i for i in range(n_new) if done[i]]
        movers = [i for i in keep if i >= n_new]
        pool = s.pages
        if pool is not None:  # the paged layout: pages go back; moved rows take their table rows along
            for row in fin:
                pool.release(row)
        if holes:
            src = torch.tensor(movers, device=s.device)
            dst = torch.tensor(holes, device=s.device)
            if pool is None:
                s.cache.move_rows(src, dst)
            st.move_rows(src, dst)
            hi = s.row_hi
            for h, mv in zip(holes, movers, strict=True):
                s.row_seq[h], s.row_sampling[h] = s.row_seq[mv], s.row_sampling[mv]
                hi[h], s.row_cap[h] = hi[mv], s.row_cap[mv]
                s.row_known[h], s.row_plen[h] = s.row_known[mv], s.row_plen[mv]
                s.row_age[h] = s.row_age[mv]
                if pool is not None:
                    pool.move(mv, h)
        s.flush_table()
        st.done[n_new:n] = True
        del s.row_seq[n_new:], s.row_sampling[n_new:]
        s.n_active = n_new
        s.rows_changed()
        if on_finish is not None:
            for res in finished:
                on_finish(res)

    # ----------------------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, requests: Sequence[Request], on_finish: FinishCallback | None = None, *,
                 plain: bool = False, controller: SdController | None = None) -> GenerationOutput:
        """Run `requests` to completion; `on_finish(result)` is called once per sequence as soon as it leaves the
        batch (from `sync()`, before this returns; e.g. to compute rewards while the tail still decodes).
        plain: decode plainly without the controller and with no hidden-state capture for this call (validation:
        nothing learns from it, the controller's state is untouched).
        controller: plan this call's steps with `controller` instead of the engine's, with no hidden-state capture
        and no tail hook (a measurement, e.g. one mode of a benchmark: only that controller sees its steps); its
        arms must fit the engine (drafters it has, verify widths within the KV headroom it was built for)."""
        if plain and controller is not None:
            raise ValueError("generate(plain=True) runs without a controller; pass one or the other")
        if not plain and controller is None:
            return self._generate(requests, on_finish, self.controller, self.tail)
        if controller is not None:
            self._check_drafters(controller.all_arms())
            widest = _verify_width(controller.all_arms())
            if widest > self.max_nodes:
                raise ValueError(f"the controller verifies up to {widest} tokens a row; the engine's KV headroom is "
                                 f"{self.max_nodes} (sized for its own controller)")
        hook, self.state.hidden_hook = self.state.hidden_hook, None
        no_tail = TailBudget(None, 0.0, 0.0, self.tail.clock)
        try:
            return self._generate(requests, on_finish, controller, no_tail)
        finally:
            self.state.hidden_hook = hook

    def _check_drafters(self, arms: Sequence[Arm]) -> None:
        """Every SD arm a controller may plan needs its drafter among the engine's proposers."""
        missing = sorted({a.drafter for a in arms if a.is_sd and a.drafter not in self.proposers})
        if missing:
            raise ValueError(f"the controller plans arms with drafters {missing}; the engine has {sorted(self.proposers)}")

    def _generate(self, requests: Sequence[Request], on_finish: FinishCallback | None,
                  ctl: SdController | None, tail: TailBudget) -> GenerationOutput:
        self._require_memory()
        s = self.state
        t_start = time.perf_counter()
        for i, req in enumerate(requests):
            if not req.prompt:
                raise ValueError(f"request {i} has an empty prompt")
            if len(req.prompt) + req.params.max_new_tokens > s.max_len:
                raise ValueError(f"request {i}: prompt {len(req.prompt)} + max_new_tokens "
                                 f"{req.params.max_new_tokens} > EngineConfig.max_len {s.max_len}")
        if s.pages is not None:
            paging.check_fits(s, requests)
        queue = deque((r, smp) for r, req in enumerate(requests) for smp in range(req.params.n))
        swapped: list[paging.Swapped] = []  # preempted sequences (paged layout), readmitted before any new one
        self.preemptions = 0  # counted afresh per generate()
        results: dict[tuple[int, int], SequenceResult] = {}
        steps: list[StepStats] = []
        s.histories = {r: [list(req.prompt) for _ in range(req.params.n)] for r, req in enumerate(requests)}
        s.begin_generate([req.params for req in requests])
        s.new_rows_version()  # new token lists: contexts built on the old ones are stale
        s.accept_stats = AcceptanceStats()
        tail.reset()
        s.done_host = None
        if ctl is not None:
            ctl.start_rollout()
        adaptive = AdaptiveLoop(s, self, ctl, tail) if ctl is not None else None
        windows = adaptive.windows if adaptive is not None else PlainWindows(s, self)
        while queue or swapped or s.n_active:
            if s.pages is not None:  # pages for this iteration's writes first, then admission by what is left
                self.preemptions += paging.reserve(s, swapped)
                if swapped:
                    paging.swap_in(s, swapped)
                items = paging.admit(s, queue, requests) if not swapped else []
                if items:
                    steps.append(self._prefill(items, requests))
            elif queue and s.n_active < s.slots:
                items = [queue.popleft() for _ in range(min(s.slots - s.n_active, len(queue)))]
                steps.append(self._prefill(items, requests))
            if not s.n_active:
                raise RuntimeError("no sequence could be admitted: the page pool holds none at its first step")
            # plain windows run one ahead of their reads on CUDA (rollout/windows.py): sync once the host has done
            # flags for the current rows
            fresh = adaptive.iteration(steps) if adaptive is not None else windows.step(steps)
            if fresh:
                self.sync(results, on_finish)
        windows.drain(steps)
        for p in {id(x): x for x in self.proposers.values()}.values():
            p.reset()
        seqs = [results[k] for k in sorted(results)]
        out = GenerationOutput(seqs, steps, time.perf_counter() - t_start)
        if ctl is not None:
            out.sd_metrics = ctl.metrics.summary()
            if tail.hook is not None:
                out.sd_metrics.update({"perf/tail_hook_s": tail.used_s, "perf/tail_hook_calls": tail.calls})
            out.sd_buckets = ctl.metrics.per_bucket()
        return out
