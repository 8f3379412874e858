"""The rollout engine's speculative step: draft with one drafter and arm shape, then the body of
rollout/speculative_body.py -- verify every active row in ONE target forward (tree attention mask over the ragged KV
cache), accept exactly (speculative/verify/verifier.py: greedy or speculative sampling, Leviathan et al. 2023), keep only accepted
K/V, commit with EOS / max_new_tokens cuts -- and ONE device->host read of its packed result (tokens emitted per
row, done flags, per-position accepted / drafted counts and the emitted tokens), which extends the host histories
directly (the drafters read those), so consecutive speculative steps never re-read the histories and
`Engine.sync()` needs no read of its own.

On CUDA the body is replayed from a graph per (batch bucket, arm shape, sampling mode) (rollout/speculative_graphs.py):
the arm fixes the branching (`DraftContext.topk`, which every drafter honours), so the body's shapes are static.
What remains per step outside the graph:
the drafter's own work, copying its proposal into the graph's buffers, and the hidden-state hook's gathers. An
EAGLE chain drafted on its draft window (speculative/drafter/draft_window.py) advances the window on the device right after
the verification (`proposer.advance`), so the hook runs only for other consumers (the spot trainer's buffer).
Everything from the read to the next step's replay leaves the GPU idle (bench/spec_host.py measures it), so that
host path is kept short: the DraftContext is reused while the rows stay (`draft_context`), a chain's kept nodes
are 0..n-1 (the hook indexes its tensors directly, one upload), and the per-row bookkeeping is Python on host ints.

`Engine.speculative_step(batch, arm)` calls `speculative_step(state, batch, arm, proposer, graphs)`; see
rollout/engine.py.
Run the tests: `python -m pytest tests/engine/test_engine_spec_greedy.py tests/spec tests/adaptive -q`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.decoding.sampling import DraftFilters, RowSampling
from worker.tlt.rollout.engine_state import EngineState
from worker.tlt.rollout.hidden_rows import emit_hidden
from worker.tlt.rollout.speculative_body import SpecInputs, SpecOut, verify_commit
from worker.tlt.rollout.speculative_graphs import VerifyGraphs
from worker.tlt.rollout.types import RequestSampling, StepStats
from worker.tlt.speculative.arm import Arm
from worker.tlt.speculative.proposers.protocol import DraftContext, Proposer


def row_filters(rows: Sequence[RequestSampling]) -> DraftFilters:
    """DraftContext.filters from the rows' settings."""
    ks = {int(p.top_k) for p in rows}
    k = ks.pop() if len(ks) == 1 else -1
    ts = {float(p.temperature) for p in rows}
    t = ts.pop() if len(ts) == 1 else -1.0
    return DraftFilters(k, any(p.top_p < 1.0 for p in rows), t if t > 0.0 else -1.0)


def draft_context(state: EngineState, batch: int, nodes: int, depth: int,
                  topk: int) -> tuple[DraftContext, list[list[int]]]:
    """The DraftContext of rows 0..batch-1 for an arm's shape, reused until the rows change (prefill, sync, a new
    generate() bump state.rows_version): its histories are the engine's own token lists, which only grow, so the
    same object stays valid from step to step, and drafters can cache per context (EagleProposer: the rows' slots
    and settings). -> (the context, its histories: the engine's lists, which the step extends)."""
    key = (state.rows_version, batch, nodes, depth, topk)
    hit = state.spec_ctx
    if hit is not None and hit[0] == key:
        return hit[1], hit[2]
    st = state.rows
    seqs = state.row_seq[:batch]
    hists = [state.histories[r][s] for r, s in seqs]
    ctx = DraftContext(
        histories=hists,
        prompt_lens=state.row_plen[:batch].tolist(),
        group_ids=[r for r, _ in seqs],
        sample_ids=[s for _, s in seqs],
        max_nodes=nodes,
        max_depth=depth,
        topk=topk,
        device=state.device,
        groups=state.histories,
        sampling=RowSampling(st.temp[:batch], st.top_p[:batch], st.top_k[:batch]),
        filters=row_filters(state.row_sampling[:batch]),
        streams=(st.key[:batch], st.n_gen[:batch]),  # views: valid at every step of this context
    )
    state.spec_ctx = (key, ctx, hists)
    return ctx, hists


def warmup_context(batch: int, topk: int, depth: int, nodes: int, params: RequestSampling, filters: DraftFilters,
                   device: torch.device) -> DraftContext:
    """A DraftContext of `batch` two-token rows (sequence ids (-1 - row, 0): none of a rollout's) for an arm's shape,
    sampled with `params`: what the engine's warm-up drafts once per eager (tree) shape, so that the first-use costs
    of the drafter's kernels do not land in a timed rollout."""
    return DraftContext(
        histories=[[0, 0] for _ in range(batch)], prompt_lens=[1] * batch, group_ids=[-1 - i for i in range(batch)],
        sample_ids=[0] * batch, max_nodes=nodes, max_depth=depth, topk=topk, device=device,
        sampling=RowSampling.uniform(batch, params.temperature, params.top_p, params.top_k, device), filters=filters)


def speculative_step(state: EngineState, batch: int, arm: Arm, proposer: Proposer,
                     graphs: VerifyGraphs | None) -> StepStats:
    """Engine.speculative_step (module docstring): draft with `proposer` in `arm`'s shape, verify (replaying
    `graphs` when there are some), commit, read once."""
    depth, nodes, topk = arm.depth, arm.verify_tokens, arm.topk
    t0 = state.clock()
    if not state.hist_fresh:
        state.sync_histories(batch)
    ctx, hists = draft_context(state, batch, nodes, depth, topk)
    prop = proposer.propose(ctx)
    n_nodes = prop.num_nodes
    if n_nodes > state.max_nodes or prop.tokens.shape[0] != batch:
        raise ValueError(f"proposal of shape {tuple(prop.tokens.shape)}: want {batch} rows, <= {state.max_nodes} nodes")
    is_chain = topk == 1
    if graphs is not None:  # the whole body replayed: one graph per arm shape and batch bucket
        width = max(nodes, n_nodes)
        d = min(depth, width - 1)
        out = graphs.run(state, prop, batch, width=width, depth=d, topk=topk)
        rr = state.bucket(batch)  # rows of the packed result
    else:
        d = min(depth, n_nodes - 1)
        inp = SpecInputs(prop.tokens, prop.parents, prop.counts, prop.draft_probs,
                         torch.full((1,), batch, dtype=torch.int64, device=state.device), None, None)
        out = verify_commit(state, inp, depth=d, topk=topk, mode=state.mode, tk=state.tk(state.n_active, n_nodes),
                            chain=is_chain)
        rr = batch
    d_max = max(d, 1)
    at_tokens = 2 * rr + 2 * d_max + 2  # packed: the emitted tokens [rr, d + 1] come last
    # a drafter that keeps its own features (EAGLE's draft window) takes the verified chain on the device
    fed = is_chain and proposer.advance(out.packed[at_tokens:].view(rr, d + 1), out.hidden, out.n)
    packed = out.packed.tolist()  # the step's one device -> host read (layout: rollout/speculative_body.py)
    n_host = packed[:batch]
    hook = state.hidden_hook
    if fed:  # the drafter holds the step's features: the hook runs only for other consumers (a training buffer)
        with proposer.advanced(n_host):
            if hook is not None and hook != getattr(proposer, "observe", None):
                _emit_step_hidden(state, batch, prop, out, n_host, is_chain)
    elif hook is not None:
        _emit_step_hidden(state, batch, prop, out, n_host, is_chain)
    at = 2 * rr  # per-position counts, then active rows and verify nodes, then the emitted tokens
    acc_host, dr_host = packed[at: at + d_max], packed[at + d_max: at + 2 * d_max]
    active_rows, verify_nodes = packed[at + 2 * d_max: at + 2 * d_max + 2]
    state.accept_stats.add(active_rows, acc_host, dr_host, verify_nodes)
    width, at = d + 1, at + 2 * d_max + 2  # emitted-run columns per row
    known, hi, cap = state.row_known, state.row_hi, state.row_cap
    small = batch <= 16  # Python per row beats numpy's per-call cost at the batches SD runs at
    for b, (hist, n) in enumerate(zip(hists, n_host, strict=True)):  # the histories follow, no other device read
        if n:
            o = at + b * width
            hist.extend(packed[o: o + n])
            if small:
                known[b] += n
                hi[b] = min(hi[b] + n, cap[b])
    if not small:
        n_arr = np.array(n_host, dtype=np.int64)
        known[:batch] += n_arr
        np.minimum(hi[:batch] + n_arr, cap[:batch], out=hi[:batch])
    full = batch == state.n_active
    state.hist_fresh = full
    state.done_host = packed[rr: rr + batch] if full else None
    while dr_host and dr_host[-1] == 0:  # positions no row drafted
        dr_host.pop()
        acc_host.pop()
    return StepStats("spec", state.n_active, batch, n_nodes, sum(n_host), sum(acc_host), state.clock() - t0,
                     arm=arm.name, accepted_pos=tuple(acc_host),
                     drafted_pos=tuple(dr_host))


def _emit_step_hidden(state: EngineState, batch: int, prop: DraftProposal, out: SpecOut, n_host: list[int],
                      is_chain: bool) -> None:
    """The hidden hook's rows of a step: root + the accepted nodes that were kept (the last kept token is the new
    root)."""
    if is_chain:  # a chain keeps nodes 0..n-1: no gather of the kept nodes
        emit_hidden(state, batch, prop.tokens, out.hidden, out.n, n_host)
        return
    kept = out.kept[:batch]
    hid = out.hidden[:batch]
    emit_hidden(state, batch, prop.tokens.gather(1, kept.clamp_max(prop.num_nodes - 1)),
                        hid.gather(1, kept[..., None].expand(-1, -1, hid.shape[-1])), out.n[:batch], n_host)
