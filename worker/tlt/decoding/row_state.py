"""Per-row device state of the rollout engine: lengths, last tokens, sampling settings, emitted tokens, history.

Row r of every tensor here belongs to the sequence in KV-cache row r. Active sequences occupy rows 0..n-1
(continuous batching moves rows to keep it so: `move_rows`). Conventions (see rollout/engine.py):
- `lens[r]`: tokens whose K/V are in the cache (columns 0..lens-1);
- `last[r]`: the last emitted token (the *root* of the next step), not yet in the cache; its position is lens[r];
- `out_tok[r, :n_gen]`, `out_lp[r, :n_gen]`: emitted tokens and their target log-probs;
- `key[r]`: the sequence's random-stream key (decoding/streams.py): its draws for emitted token i are keyed on
  (key, i), so they travel with the row (moves, preemption) and never depend on the other rows.
Columns past the live region are scratch: masked writes go there instead of branching.
"""

from __future__ import annotations

import torch

MAX_EOS = 8  # stop tokens per request


class RowState:
    def __init__(self, slots: int, max_len: int, max_new: int, spare: int, device: torch.device) -> None:
        """`max_len`: KV columns (T); `max_new`: emitted-token capacity; `spare`: scratch columns for masked writes."""
        self.slots, self.max_len, self.cap, self.spare = slots, max_len, max_new, spare

        def z(*shape: int, dtype: torch.dtype = torch.int64, fill: float = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.lens = z(slots)  # [S] cached tokens
        self.last = z(slots)  # [S] root token
        self.n_gen = z(slots)  # [S] emitted so far
        self.done = z(slots, dtype=torch.bool, fill=True)  # [S] finished (or an empty row)
        self.max_new = z(slots, fill=1)  # [S] max_new_tokens
        self.prompt_len = z(slots)  # [S]
        self.group = z(slots, fill=-1)  # [S] request index (siblings share it)
        self.temp = z(slots, dtype=torch.float32, fill=1.0)  # [S]
        self.top_p = z(slots, dtype=torch.float32, fill=1.0)  # [S]
        self.top_k = z(slots)  # [S]
        self.eos = z(slots, MAX_EOS, fill=-1)  # [S, E] stop tokens, -1 padding
        self.key = z(slots)  # [S] random-stream key (decoding/streams.sequence_key)
        self.out_tok = z(slots, max_new + spare)  # [S, cap + spare]
        self.out_lp = z(slots, max_new + spare, dtype=torch.float32)  # [S, cap + spare]

    def tensors(self) -> list[torch.Tensor]:
        return [self.lens, self.last, self.n_gen, self.done, self.max_new, self.prompt_len, self.group, self.temp,
                self.top_p, self.top_k, self.eos, self.key, self.out_tok, self.out_lp]

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of every tensor (a CUDA-graph warm-up commits for real; `restore` undoes it)."""
        return [t.clone() for t in self.tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        """Write a snapshot back in place (the captured graphs keep reading the same addresses)."""
        for t, s in zip(self.tensors(), saved, strict=True):
            t.copy_(s)

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:  # [M] int64 each, disjoint
        for t in self.tensors():
            t.index_copy_(0, dst, t.index_select(0, src))

    def commit_no_sync(
        self,
        rows: slice,
        toks: torch.Tensor,  # [B, W] emitted run per row (left-aligned)
        lps: torch.Tensor,  # [B, W] their target log-probs
        n_emit: torch.Tensor,  # [B] int64 run length before EOS / budget truncation (0 = nothing)
    ) -> torch.Tensor:  # [B] int64 tokens actually emitted
        """Append each row's run, cut after its first EOS and at max_new_tokens; advance lens by the kept count
        (the root plus the accepted drafts enter the cache; the last kept token becomes the new root)."""
        b, w = toks.shape
        dev = toks.device
        i = torch.arange(w, device=dev)
        done = self.done[rows]
        in_run = i[None, :] < n_emit[:, None]
        is_eos = (toks[:, :, None] == self.eos[rows][:, None, :]).any(-1) & in_run
        first_eos = torch.where(is_eos, i[None, :], w).min(dim=1).values
        remaining = self.max_new[rows] - self.n_gen[rows]
        n = torch.minimum(torch.minimum(n_emit, first_eos + 1), remaining)
        n = torch.where(done, torch.zeros_like(n), n.clamp_min(0))
        finished = ~done & ((first_eos < n) | (n >= remaining))
        valid = i[None, :] < n[:, None]
        n_gen = self.n_gen[rows]
        out_col = torch.where(valid, n_gen[:, None] + i[None, :], self.cap + i[None, :])
        self.out_tok[rows].scatter_(1, out_col, toks)
        self.out_lp[rows].scatter_(1, out_col, lps.float())
        new_last = toks.gather(1, (n - 1).clamp_min(0)[:, None]).squeeze(1)
        self.last[rows] = torch.where(n > 0, new_last, self.last[rows])
        self.lens[rows] += n
        self.n_gen[rows] += n
        self.done[rows] |= finished
        return n
