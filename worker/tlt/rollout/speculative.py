"""The rollout engine's speculative step: draft with one drafter and arm shape, then the body of
rollout/spec_body.py -- verify every active row in ONE target forward (tree attention mask over the ragged KV
cache), accept exactly (spec/verify.py: greedy or speculative sampling, Leviathan et al. 2023), keep only accepted
K/V, commit with EOS / max_new_tokens cuts -- and ONE device->host read of its packed result (tokens emitted per
row, done flags, per-position accepted / drafted counts and the emitted tokens), which extends the host histories
directly (the drafters read those), so consecutive speculative steps never re-read the histories and
`Engine.sync()` needs no read of its own.

On CUDA the body is replayed from a graph per (batch bucket, arm shape, sampling mode) (rollout/verify_graphs.py)
whenever the drafter's frozen config fixes its branching (`topk`: n-gram, small model, EAGLE); a drafter without
one runs the body eagerly after reading its tree's bounds (host syncs). What remains per step outside the graph:
the drafter's own work, copying its proposal into the graph's buffers, and the hidden-state hook's gathers.

`Engine.speculative_step(batch, arm)` calls `speculative_step(engine, batch, arm)`; see rollout/engine.py.
Run the tests: `python -m pytest tests/engine/test_engine_spec_greedy.py tests/spec tests/adaptive -q`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from worker.tlt.adaptive.arms import Arm
from worker.tlt.rollout.adaptive_loop import proposer_topk, set_proposer_topk
from worker.tlt.rollout.spec_body import SpecInputs, verify_commit
from worker.tlt.rollout.types import StepStats
from worker.tlt.spec.proposer import DraftContext
from worker.tlt.spec.sampling import SamplingParams as RowParams
from worker.tlt.spec.tree import children_table, node_depths

if TYPE_CHECKING:
    from worker.tlt.rollout.engine import Engine


def row_filters(params: Sequence[tuple[float, float, int]]) -> tuple[int, bool]:
    """DraftContext.filters from the rows' host-side (temperature, top_p, top_k)."""
    ks = {int(p[2]) for p in params}
    k = ks.pop() if len(ks) == 1 else -1
    return k, any(p[1] < 1.0 for p in params)


def speculative_step(engine: Engine, batch: int, arm: Arm | None = None) -> StepStats:
    """Engine.speculative_step (module docstring)."""
    if arm is None:
        proposer, depth, nodes = engine.proposer, engine.spec.depth, engine.spec.num_nodes
        topk = proposer_topk(proposer)
    else:
        proposer, depth, nodes = engine.proposers.get(arm.drafter), arm.depth, arm.verify_tokens
        topk = arm.topk if proposer is not None and set_proposer_topk(proposer, arm.topk) else None
    if proposer is None:
        raise RuntimeError(f"speculative_step needs a proposer (arm {arm.name if arm else None})")
    t0 = engine.clock()
    st = engine.rows
    if not engine._hist_fresh:
        engine._sync_histories(batch)
    seqs = engine.row_seq[:batch]
    ctx = DraftContext(
        histories=[engine.histories[r][s] for r, s in seqs],
        prompt_lens=engine.row_plen[:batch].tolist(),
        group_ids=[r for r, _ in seqs],
        sample_ids=[s for _, s in seqs],
        max_nodes=nodes,
        max_depth=depth,
        device=engine.device,
        groups=engine.histories,
        sampling=RowParams(st.temp[:batch], st.top_p[:batch], st.top_k[:batch]),
        filters=row_filters(engine.row_params[:batch]),
    )
    prop = proposer.propose(ctx)
    n_nodes = prop.num_nodes
    if n_nodes > engine.max_nodes or prop.tokens.shape[0] != batch:
        raise ValueError(f"proposal of shape {tuple(prop.tokens.shape)}: want {batch} rows, <= {engine.max_nodes} nodes")
    graphs = getattr(engine, "verify_graphs", None)  # rollout/verify_graphs.py (CUDA), else the eager body
    if topk is not None and graphs is not None:  # the whole body replayed: one graph per arm shape and batch bucket
        width = max(nodes, n_nodes)
        d = min(depth, width - 1)
        out = graphs.run(engine, prop, batch, width=width, depth=d, topk=topk)
        rr = engine.bucket(batch)  # rows of the packed result
    else:
        d = min(depth, n_nodes - 1)
        if topk is None:  # no fixed branching: read the tree's bounds once (host syncs); the body needs them static
            d = max(int(node_depths(prop.parents).max()), 0) if n_nodes > 1 else 0
            kids = children_table(prop.parents, prop.counts)
            k = max(int(kids.shape[2]), 1)
            chained = (prop.parents[:, 1:] == engine._cols[: n_nodes - 1][None, :]) | (prop.parents[:, 1:] < 0)
            is_chain = bool(chained.all())
        else:
            k, is_chain = topk, topk == 1
        inp = SpecInputs(prop.tokens, prop.parents, prop.counts, prop.draft_probs,
                         torch.full((1,), batch, dtype=torch.int64, device=engine.device), None, None)
        out = verify_commit(engine, inp, depth=d, topk=k, mode=engine._mode,
                            tk=engine._tk(engine.n_active, n_nodes), chain=is_chain)
        rr = batch
    d_max = max(d, 1)
    packed = out.packed.tolist()  # the step's one device -> host read (layout: rollout/spec_body.py)
    n_host, done_host = packed[:batch], packed[rr : rr + batch]
    if engine.hidden_hook is not None:  # root + the accepted nodes that were kept (the last kept token is the new root)
        kept = out.kept[:batch]
        hid = out.hidden[:batch]
        engine._emit_hidden(batch, prop.tokens.gather(1, kept.clamp_max(n_nodes - 1)),
                            hid.gather(1, kept[..., None].expand(-1, -1, hid.shape[-1])), out.n[:batch], n_host)
    acc_host, dr_host = packed[2 * rr : 2 * rr + d_max], packed[2 * rr + d_max : 2 * rr + 2 * d_max]
    active_rows, verify_nodes = packed[2 * rr + 2 * d_max : 2 * rr + 2 * d_max + 2]
    toks = packed[2 * rr + 2 * d_max + 2 :]
    engine.accept_stats.add(active_rows, acc_host, dr_host, verify_nodes)
    width = d + 1  # emitted-run columns per row
    for b, (r, s) in enumerate(seqs):  # the histories follow without another device read
        if n_host[b]:
            engine.histories[r][s].extend(toks[b * width : b * width + n_host[b]])
    engine.row_known[:batch] += np.asarray(n_host, dtype=np.int64)
    engine._hist_fresh = batch == engine.n_active
    engine._done_host = [bool(x) for x in done_host] if batch == engine.n_active else None
    engine.row_hi[:batch] = np.minimum(engine.row_hi[:batch] + np.asarray(n_host, dtype=np.int64), engine.row_cap[:batch])
    while dr_host and dr_host[-1] == 0:  # positions no row drafted
        dr_host.pop()
        acc_host.pop()
    return StepStats("spec", engine.n_active, batch, n_nodes, sum(n_host), sum(acc_host), engine.clock() - t0,
                     arm=arm.name if arm is not None else None, accepted_pos=tuple(acc_host),
                     drafted_pos=tuple(dr_host))

