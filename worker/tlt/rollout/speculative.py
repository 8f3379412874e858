"""The rollout engine's speculative step: draft with one drafter and arm shape, verify every active row in ONE target
forward (tree attention mask over the ragged KV cache), accept exactly (spec/verify.py: greedy or speculative
sampling, Leviathan et al. 2023), keep only accepted K/V, commit with EOS / max_new_tokens cuts.

Host syncs: a drafter whose frozen config has `topk` (n-gram, small model, EAGLE) is pointed at the arm's branching,
which bounds the tree's depth and children for the verifier (no `.item()` there) and tells a chain from a tree
without reading the proposal. The step ends with ONE device->host read of a packed vector: tokens emitted per row,
done flags, per-position accepted / drafted counts and the emitted tokens themselves, which extend the host
histories directly (the drafters read those), so consecutive speculative steps never re-read the histories and
`Engine.sync()` needs no read of its own. Prompt lengths come from a host mirror. What remains per step: the
drafter's own work, and the hidden-state hook's boolean indexing when a hook is attached.

Verify forward: replayed from a CUDA graph per (batch bucket, arm verify width) when the engine
holds `verify_graphs` (rollout/verify_graphs.py; a proposal narrower than the arm's width is padded), else eager.
Either way its hidden output is the hook's row width (EngineConfig.capture_layers: the EAGLE-3 layer inputs too).

`Engine.speculative_step(batch, arm)` calls `speculative_step(engine, batch, arm)`; see rollout/engine.py.
Run the tests: `python -m pytest tests/engine/test_engine_spec_greedy.py tests/adaptive -q`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from worker.tlt.adaptive.arms import Arm
from worker.tlt.rollout.adaptive_loop import proposer_topk, set_proposer_topk
from worker.tlt.rollout.decode_step import hook_rows
from worker.tlt.rollout.types import StepStats
from worker.tlt.spec.proposer import DraftContext
from worker.tlt.spec.sampling import SamplingParams as RowParams
from worker.tlt.spec.sampling import processed_probs
from worker.tlt.spec.tree import ancestor_mask, node_depths
from worker.tlt.spec.verify import verify_greedy, verify_sampling

if TYPE_CHECKING:
    from worker.tlt.rollout.engine import Engine


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
    rows, st = slice(0, batch), engine.rows
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
    )
    prop = proposer.propose(ctx)
    n_nodes = prop.num_nodes
    if n_nodes > engine.max_nodes or prop.tokens.shape[0] != batch:
        raise ValueError(f"proposal of shape {tuple(prop.tokens.shape)}: want {batch} rows, <= {engine.max_nodes} nodes")
    lens = st.lens[:batch]
    node_depth = node_depths(prop.parents)  # [B, N]
    anc = ancestor_mask(prop.parents)  # [B, N, N]
    node_i = engine._cols[:n_nodes]
    graphs = getattr(engine, "verify_graphs", None)  # rollout/verify_graphs.py (CUDA), else the eager forward
    width = max(nodes, n_nodes)  # the arm's verify width: one graph per arm shape, whatever the drafts' length
    if graphs is not None:
        hi = int(engine.row_hi[: engine.n_active].max()) if engine.n_active else 0
        logits, hidden = graphs.run(prop.tokens, node_depth, anc, lens, bucket=engine.bucket(batch), width=width,
                                    hi=hi)
    else:
        pos = lens[:, None] + node_depth
        widx = lens[:, None] + node_i[None, :]
        tk = engine._tk(engine.n_active, n_nodes)
        mask = (engine._cols[:tk][None, None, :] < lens[:, None, None]).expand(batch, n_nodes, tk).clone()
        mask.scatter_(2, widx[:, None, :].expand(batch, n_nodes, n_nodes), anc)
        layers = engine.hook_layers
        logits, hidden, cap = engine.model.forward_hidden(prop.tokens, pos, engine.cache, write_idx=widx,
                                                          attn_mask=mask, layers=layers)
        hidden = hook_rows(hidden, cap, layers)  # [B, N, (k+1)H]
    # a drafter whose config fixes topk bounds the branching and depth: no host sync in the verifier
    max_depth = min(depth, n_nodes - 1) if topk is not None else None
    max_children = topk
    if engine._all_greedy():
        res = verify_greedy(prop, logits, max_depth=max_depth, max_children=max_children)
    else:
        temp, top_p, top_k = engine._params(rows)
        probs = processed_probs(logits, temp, top_p, top_k)  # type: ignore[arg-type]
        res = verify_sampling(prop, probs, engine.gen, max_depth=max_depth, max_children=max_children)
    n_acc = res.num_emitted - 1
    acc_nodes = res.accepted_nodes[:, : res.accepted_nodes.shape[1] - 1].clamp_min(0)  # [B, D]
    # a chain's accepted nodes already sit at lens+1.. (node i at column lens+i); a tree's are moved there
    if topk is not None:
        is_chain = topk == 1
    else:
        is_chain = bool(((prop.parents[:, 1:] == node_i[None, :-1]) | (prop.parents[:, 1:] < 0)).all())
    if not is_chain:
        engine.cache.compact_accepted(lens, acc_nodes, n_acc)
    active = ~st.done[:batch]
    n = st.commit_no_sync(rows, res.tokens, res.logprobs, res.num_emitted)
    if engine.hidden_hook is not None:  # root + the accepted nodes that were kept (the last kept token is the new root)
        kept = torch.cat([torch.zeros_like(acc_nodes[:, :1]), acc_nodes], dim=1)
        engine._emit_hidden(batch, prop.tokens.gather(1, kept),
                          hidden.gather(1, kept[..., None].expand(-1, -1, hidden.shape[-1])), n)
    engine.accept_stats.observe(prop, res)
    # per position k = 1..D: sequences that accepted / had a draft token at depth k
    d_max = max(n_nodes - 1, 1)
    ks = engine._cols[1 : d_max + 1]
    row_depth = node_depth.masked_fill(node_i[None, :] >= prop.counts[:, None], 0).max(dim=1).values  # [B]
    acc_pos = ((n_acc[:, None] >= ks[None, :]) & active[:, None]).sum(0)
    dr_pos = ((row_depth[:, None] >= ks[None, :]) & active[:, None]).sum(0)
    width = res.tokens.shape[1]
    packed = torch.cat([n, st.done[:batch].to(torch.int64), acc_pos, dr_pos, res.tokens.reshape(-1)]).tolist()
    n_host, done_host = packed[:batch], packed[batch : 2 * batch]
    acc_host, dr_host = packed[2 * batch : 2 * batch + d_max], packed[2 * batch + d_max : 2 * batch + 2 * d_max]
    toks = packed[2 * batch + 2 * d_max :]
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

