"""The rollout engine's prefill: admit (request, sample) pairs into the rows after the active ones, with one forward
per distinct prompt (chunks of prompts within `EngineConfig.prefill_tokens`), the prompt's K/V copied to its
siblings (the other samples of a GRPO group), the row state initialised, and each row's first token sampled.
The hidden-state hook sees every prompt position (with `EngineConfig.capture_layers`, the captured layers too).
With the fused kernels on, a chunk of at most FUSED_PREFILL_TOKENS padded tokens runs them too (the decode forward's
path); larger chunks run the model's torch forward. On CUDA with graphs, chunks of at most GRAPH_PREFILL_TOKENS are
replayed from a CUDA graph per shape (rollout/prefill_graphs.py), and the first tokens go through the fused sampler
where the decode step would (two kernels instead of ~40 torch ops).

`Engine.prefill(items, requests)` calls `prefill(state, items, requests, graphs)`; see rollout/engine.py.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch

from worker.tlt.decoding.row_state import MAX_EOS
from worker.tlt.rollout.decode_step import choose, hook_rows
from worker.tlt.rollout.engine_state import EngineState, round_up
from worker.tlt.rollout.paging import row_need
from worker.tlt.rollout.prefill_graphs import PrefillGraphs
from worker.tlt.rollout.types import Request, StepStats

FUSED_PREFILL_TOKENS = 512  # padded prompt tokens up to which a prefill chunk runs the fused kernels
# ... and up to which it is replayed from a CUDA graph: batch 8 of GSM8K prompts (8 x 144) was a 32 ms torch prefill
# on an H200, host-bound; a rollout's chunk (64 x 160) is not launch-bound, and a graph per shape would hold its
# activations in the pool
GRAPH_PREFILL_TOKENS = 4096


def chunk_forward(state: EngineState, row0: int, ids: torch.Tensor,
                  plen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The forward of c prompts [c, s] (lengths plen [c], right-padded) into cache rows row0.. -> (logits at each
    prompt's last token [c, 1, V], final-norm hidden [c, s, H], captured layer inputs). A chunk of at most
    FUSED_PREFILL_TOKENS padded tokens (a batch-1 prompt) runs the fused kernels where they are on: torch's ~25
    launches per layer made a 200-token GSM8K prompt a 16 ms prefill on an H200, host-bound; larger chunks keep
    torch's GEMMs."""
    c, s = ids.shape
    small = state.step.fused and c * s <= FUSED_PREFILL_TOKENS
    forward = state.step.forward_hidden if small else state.model.forward_hidden
    cols = state.cols[:s]
    pos = cols.expand(c, s)
    mask = (cols[None, :] <= cols[:, None])[None] & (cols < plen[:, None])[:, None]
    return forward(ids, pos, state.cache, cache_rows=slice(row0, row0 + c), write_idx=pos, attn_mask=mask,
                   logits_at=(plen - 1)[:, None], layers=state.hook_layers)


def prefill(state: EngineState, items: list[tuple[int, int]], requests: Sequence[Request],
            prefill_graphs: PrefillGraphs | None) -> StepStats:
    """Engine.prefill (module docstring); small chunks replay `prefill_graphs` when there are some."""
    t0 = time.perf_counter()
    head: list[tuple[int, int]] = []  # first sample of each distinct request: prefilled
    tail: list[tuple[int, int]] = []  # its siblings: K/V copied from the first
    for it in items:
        (tail if any(h[0] == it[0] for h in head) else head).append(it)
    order = head + tail
    firsts = {r: i for i, (r, _) in enumerate(head)}
    r0, m = state.n_active, len(order)
    uniq = [order[i][0] for i in range(len(firsts))]  # request of rows r0 .. r0+u-1
    dev = state.device
    pool = state.pages
    if pool is not None:  # the paged layout: each prompt's pages (and a window's lookahead) before its forward
        for i, r in enumerate(uniq):
            n_prompt = len(requests[r].prompt)
            need = int(row_need(state, n_prompt, n_prompt + requests[r].params.max_new_tokens))
            if not pool.grow(r0 + i, need):
                raise RuntimeError("prefill admitted more sequences than the free pages hold (rollout/paging.admit)")
        state.flush_table()
    last_logits = torch.empty(len(uniq), state.model.args.vocab_size, device=dev, dtype=torch.float32)
    j = 0
    while j < len(uniq):  # chunks of distinct prompts within the token budget
        s_max, c = 0, 0
        while j + c < len(uniq):
            s_new = max(s_max, len(requests[uniq[j + c]].prompt))
            if c and round_up(s_new, 16) * (c + 1) > state.config.prefill_tokens:
                break
            s_max, c = s_new, c + 1
        s = round_up(s_max, 16)
        ids = torch.zeros(c, s, dtype=torch.int64)
        plen = torch.tensor([len(requests[uniq[j + i]].prompt) for i in range(c)])
        for i in range(c):
            ids[i, : plen[i]] = torch.tensor(requests[uniq[j + i]].prompt)
        ids, plen = ids.to(dev), plen.to(dev)
        # chunks up to GRAPH_PREFILL_TOKENS replay a CUDA graph once their shape was seen (rollout/prefill_graphs.py)
        graphs = prefill_graphs if c * s <= GRAPH_PREFILL_TOKENS else None
        if graphs is not None:
            body = functools.partial(chunk_forward, state)
            logits, hidden, cap = graphs(body, r0 + j, ids, plen, state.hook_layers)
        else:
            logits, hidden, cap = chunk_forward(state, r0 + j, ids, plen)
        last_logits[j : j + c] = logits[:, 0].float()
        if state.hidden_hook is not None:
            valid = state.cols[:s][None, :] < plen[:, None]
            seq = [order[j + i] for i in range(c) for _ in range(int(plen[i]))]
            state.hidden_hook(seq, ids[valid], hook_rows(hidden, cap, state.hook_layers)[valid])
        j += c
    # siblings share their prompt's K/V: the full pages by reference, a copy of the partial one (paged); a copy
    src = [r0 + firsts[r] for r, _ in order[len(uniq):]]
    if src and pool is not None:
        copies: list[tuple[int, int]] = []
        for i, (r, _) in enumerate(order[len(uniq):]):
            row, n_prompt = r0 + len(uniq) + i, len(requests[r].prompt)
            got = pool.share(src[i], row, n_prompt)
            need = int(row_need(state, n_prompt, n_prompt + requests[r].params.max_new_tokens))
            if got is None or not pool.grow(row, need):
                raise RuntimeError("prefill admitted more sequences than the free pages hold (rollout/paging.admit)")
            copies += got
        if copies:
            state.cache.copy_pages(*(torch.tensor(c, device=dev) for c in zip(*copies, strict=True)))
        state.flush_table()
    elif src:
        dst = torch.arange(r0 + len(uniq), r0 + m, device=dev)
        state.cache.move_rows(torch.tensor(src, device=dev), dst)
    # row state
    rows = slice(r0, r0 + m)
    st = state.rows
    plens = [len(requests[r].prompt) for r, _ in order]
    for i, (r, _) in enumerate(order):
        p = requests[r].params
        eos = p.eos_ids if p.eos_ids is not None else state.eos_ids
        if len(eos) > MAX_EOS:
            raise ValueError(f"at most {MAX_EOS} eos ids per request")
        state.row_known[r0 + i] = 0
        st.eos[r0 + i] = torch.tensor(list(eos) + [-1] * (MAX_EOS - len(eos)), device=dev)
        state.row_seq.append((r, _))
        state.row_age[r0 + i] = state.admitted
        state.admitted += 1
        state.row_sampling.append(p)
        state.row_hi[r0 + i] = plens[i]  # (folds pending plain steps into the old rows first)
        state.row_plen[r0 + i] = plens[i]
        state.row_cap[r0 + i] = plens[i] + p.max_new_tokens
    host = torch.tensor(
        [[plens[i] - 1, plens[i], requests[r].params.max_new_tokens, r, requests[r].params.top_k]
         for i, (r, _) in enumerate(order)], dtype=torch.int64).to(dev)
    st.lens[rows], st.prompt_len[rows], st.max_new[rows], st.group[rows], st.top_k[rows] = host.unbind(1)
    fl = torch.tensor([[requests[r].params.temperature, requests[r].params.top_p] for r, _ in order],
                      dtype=torch.float32).to(dev)
    st.temp[rows], st.top_p[rows] = fl.unbind(1)
    st.n_gen[rows] = 0
    st.key[rows] = torch.tensor(state.sequence_keys(order), dtype=torch.int64).to(dev)  # each sequence's own stream
    st.done[rows] = False
    state.n_active += m
    state.rows_changed()
    logits = last_logits[torch.tensor([firsts[r] for r, _ in order], device=dev)]
    if state.step.samples_fused(state.mode, m):  # two kernels instead of ~40 torch ops (rollout/decode_step.py)
        n = state.step.fused_tail(m, state.mode, logits, None, row0=r0)
    else:
        tok, lp = choose(logits, state.mode, st, rows)
        n = st.commit_no_sync(rows, tok[:, None], lp[:, None], torch.ones_like(tok))
    state.hist_fresh, state.done_host = False, None
    return StepStats("prefill", m, m, int(max(plens)), int(n.sum()), 0, time.perf_counter() - t0)
