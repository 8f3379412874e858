"""The speculative step after the proposal, as one fixed-shape body with no host sync: tree mask over the ragged
KV cache -> ONE target forward of every node -> exact acceptance (speculative/verify/verifier.py) -> keep the accepted K/V ->
commit with EOS / max_new_tokens cuts -> per-position stats, all packed into one int64 vector for one host read.

The commit and the counts after the acceptance are one Triton kernel where the engine's commits are fused
(kernels/spec_commit.py; `torch_commit` is the same in torch, the CPU path and the kernel's reference).

The same body runs eagerly (CPU, or a drafter without a fixed branching) and captured whole in a CUDA graph per
(rows, width, depth, topk, sampling mode, drafter probs or not) (rollout/speculative_graphs.py). On an H200 the eager
acceptance and bookkeeping alone launched ~400 small kernels per step (as much time as a whole graphed decode step),
which is what kept speculative decoding slower than plain decoding there.

Rows 0..n_rows-1 are the batch; rows n_rows..R-1 (a graph's padding up to its batch bucket) write their scratch
K/V at columns 0..W-1, attend only themselves and commit nothing. Nodes past a row's `counts` are padding the
verifier never reads (their parents are -1). Randomness: each row's own stream (`spec_draws`: acceptance uniforms
and the last token's Exp(1) noise keyed on the row's stream key and emitted count, decoding/streams.py), computed in
the body when eager; a graph reads static buffers (`uniforms`, `noise`) that the caller refills with the same call
before each replay. So a row's speculative step accepts and draws the same whatever else is in the batch.

Packed output (int64): [n (R) | done (R) | accepted at depth k (D) | drafted at depth k (D) | active rows, verify
nodes (2) | tokens (R x (D+1))]: n = tokens emitted per row after truncation, done = finished flags after the commit;
the counts are over the rows that were active before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.tlt.decoding.draft_types import DraftProposal
from worker.tlt.decoding.row_state import RowState
from worker.tlt.decoding.sampling import processed_probs
from worker.tlt.decoding.streams import ACCEPT, RESIDUAL, row_uniforms
from worker.tlt.kernels import fused_available, stream_noise
from worker.tlt.rollout.decode_step import GREEDY, Mode, hook_rows
from worker.tlt.rollout.engine_state import EngineState
from worker.tlt.speculative.proposers.draft_tree import ancestor_mask, depths_from_ancestors
from worker.tlt.speculative.verify.verifier import verify_greedy, verify_sampling


@dataclass
class SpecInputs:
    """A proposal laid out for the body (static buffers when graphed)."""

    tokens: torch.Tensor  # [R, W] int64 node tokens, root first
    parents: torch.Tensor  # [R, W] int64 parent node (-1: root or padding)
    counts: torch.Tensor  # [R] int64 valid nodes per row
    draft_probs: torch.Tensor | None  # [R, W, V] drafter q per node (None: deterministic drafter)
    n_rows: torch.Tensor  # [1] int64 rows of the batch (the rest are padding)
    uniforms: torch.Tensor | None  # [R, depth * topk] U(0, 1) acceptance draws (a graph's; None: drawn in the body)
    noise: torch.Tensor | None  # [R, V] Exp(1) draws of the final token (a graph's; None: drawn in the body)

    def proposal(self) -> DraftProposal:
        return DraftProposal(self.tokens, self.parents, self.counts, self.draft_probs)


@dataclass(frozen=True)
class SpecOut:
    packed: torch.Tensor  # [2R + 2D + 2 + R(D+1)] int64 (module docstring)
    hidden: torch.Tensor  # [R, W, F] hook rows of every node
    kept: torch.Tensor  # [R, D+1] int64 node of each kept position (root, then the accepted nodes)
    n: torch.Tensor  # [R] int64 tokens emitted


def spec_draws(rows: RowState, r: int, depth: int, topk: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The randomness of a speculative step of rows 0..r-1 -> (uniforms [R, max(D, 1) * max(topk, 1)]: one per
    tried child, column d * topk + j for child j at depth d; noise [R, V]: Exp(1) of the token drawn last), keyed on
    each row's stream and emitted count: fresh every step (each step emits at least one token)."""
    keys, pos = rows.key[:r], rows.n_gen[:r]
    return (row_uniforms(keys, pos, ACCEPT, max(depth, 1) * max(topk, 1)),
            stream_noise(keys, pos, RESIDUAL, vocab))


def fused_chain_verify(logits: torch.Tensor, mode: Mode, *, chain: bool, topk: int) -> bool:
    """Whether acceptance runs in kernels/chain_verify.py (3 Triton kernels) instead of processed_probs +
    verify_sampling (~10 torch kernels per depth, ~1 ms per step on an H200 at batch 8, depth 6): a chain sampled
    with one temperature and no top-k / top-p, on CUDA with triton (CPU keeps the torch path the tests compare to)."""
    if not (chain and topk == 1 and logits.is_cuda and mode.kind == "uniform") or fused_available(logits.device):
        return False
    return mode.temperature > 0.0 and mode.top_p >= 1.0 and (mode.top_k <= 0 or mode.top_k >= logits.shape[-1])


def verify_commit(state: EngineState, inp: SpecInputs, *, depth: int, topk: int, mode: Mode, tk: int,
                  chain: bool) -> SpecOut:
    """The body (module docstring). depth: the verifier's depth bound D; topk: max children per node; mode: the
    engine's sampling mode; tk: attention columns; chain: every row's nodes form a chain (no K/V compaction)."""
    st, cache = state.rows, state.cache
    r, w = inp.tokens.shape
    dev = inp.tokens.device
    row_i = torch.arange(r, device=dev)
    node_i = torch.arange(w, device=dev)
    in_batch = row_i < inp.n_rows
    lens = torch.where(in_batch, st.lens[:r], 0)
    if chain:  # node i at depth i, its ancestors the nodes before it (padding nodes too: nothing reads them)
        node_depth = node_i.expand(r, w)
        anc = node_i[None, :] <= node_i[:, None]
    else:
        anc = ancestor_mask(inp.parents)  # [R, W, W] ancestor-or-self
        node_depth = depths_from_ancestors(anc)  # [R, W]
    pos = lens[:, None] + node_depth
    widx = lens[:, None] + node_i[None, :]
    mask = (torch.arange(tk, device=dev)[None, None, :] < lens[:, None, None]).expand(r, w, tk).clone()
    mask.scatter_(2, widx[:, None, :].expand(r, w, w), anc.expand(r, w, w))
    layers = state.hook_layers
    # the engine's cached forward: torch, or the fused Triton kernels (EngineConfig.fused_kernels)
    logits, hidden, cap = state.step.forward_hidden(inp.tokens, pos, cache, write_idx=widx, attn_mask=mask,
                                                     layers=layers)
    prop = inp.proposal()
    uniforms, noise = inp.uniforms, inp.noise
    if mode != GREEDY and (uniforms is None or noise is None):  # eager: computed here (a graph's are refilled)
        uniforms, noise = spec_draws(st, r, depth, topk, logits.shape[-1])
    if mode == GREEDY:
        res = verify_greedy(prop, logits, max_depth=depth, max_children=topk)
    elif fused_chain_verify(logits, mode, chain=chain, topk=topk):
        from worker.tlt.kernels.chain_verify import chain_verify  # triton: imported on the CUDA path only

        res = chain_verify(logits, inp.tokens, inp.counts, inp.draft_probs, depth, mode.temperature,
                           uniforms=uniforms, noise=noise)  # = the torch branch's draws
    else:
        temp: float | torch.Tensor
        top_p: float | torch.Tensor
        top_k: int | torch.Tensor
        if mode.kind == "uniform":
            temp, top_p, top_k = mode.temperature, mode.top_p, mode.top_k
        else:
            temp, top_p, top_k = st.temp[:r], st.top_p[:r], st.top_k[:r]
        probs = processed_probs(logits, temp, top_p, top_k)
        res = verify_sampling(prop, probs, max_depth=depth, max_children=topk, uniforms=uniforms, noise=noise)
    n_acc = res.num_emitted - 1
    acc_nodes = res.accepted_nodes[:, :depth].clamp_min(0)  # [R, D]
    if not chain:  # a chain's accepted nodes already sit at lens+1.. (node i at column lens+i)
        cache.compact_accepted(lens, acc_nodes, n_acc)
    kept = torch.cat([torch.zeros_like(acc_nodes[:, :1]), acc_nodes], dim=1)
    row_depth = None if chain else node_depth.masked_fill(node_i[None, :] >= inp.counts[:, None], 0).amax(1)
    commit = torch_commit
    if state.step.commits_fused:  # one kernel for ~60 small torch ones
        from worker.tlt.kernels.spec_commit import spec_commit as commit  # triton: imported on the fused path only
    packed, n = commit(res.tokens, res.logprobs, res.num_emitted, inp.counts, row_depth, inp.n_rows, st, depth)
    return SpecOut(packed, hook_rows(hidden, cap, layers), kept, n)


def torch_commit(tokens: torch.Tensor, logprobs: torch.Tensor, emitted: torch.Tensor, counts: torch.Tensor,
                 row_depth: torch.Tensor | None, n_rows: torch.Tensor, rows: RowState,
                 depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The body's commit and counts in torch (kernels/spec_commit.py's reference and its arguments): rows 0..R-1
    commit their runs (rows past n_rows nothing); -> (packed result, tokens emitted per row)."""
    r = tokens.shape[0]
    in_batch = torch.arange(r, device=tokens.device) < n_rows
    active = ~rows.done[:r] & in_batch
    n = rows.commit_no_sync(slice(0, r), tokens, logprobs, torch.where(in_batch, emitted, 0))
    ks = torch.arange(1, max(depth, 1) + 1, device=tokens.device)
    if row_depth is None:  # a chain's
        row_depth = counts - 1
    acc_pos = (((emitted - 1)[:, None] >= ks[None, :]) & active[:, None]).sum(0)
    dr_pos = ((row_depth[:, None] >= ks[None, :]) & active[:, None]).sum(0)
    nodes = torch.where(active, counts, 0).sum()
    packed = torch.cat([n, rows.done[:r].to(torch.int64), acc_pos, dr_pos, torch.stack([active.sum(), nodes]),
                        tokens.reshape(-1)])
    return packed, n
