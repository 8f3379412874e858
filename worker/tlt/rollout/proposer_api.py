"""What the engine hands a drafter and what it expects back: `DraftContext` and the `Proposer` Protocol.

A proposer returns a spec.types.DraftProposal for rows 0..B-1: column 0 = each row's root (`ctx.roots`), then a
chain or tree of drafted tokens, at most `ctx.spec.num_nodes` nodes. Optional hooks a stateful drafter (one with
its own KV cache, e.g. spec/small_model.py) may define, called by the engine when present:
`reset(slots)` at the start of generate(), `on_admit(row0, m)` when rows row0..row0+m-1 get new sequences,
`move_rows(src, dst)` when continuous batching moves rows, `observe(result, ctx)` after each verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from worker.tlt.rollout.types import SpecConfig
from worker.tlt.spec.types import DraftProposal


@dataclass(frozen=True)
class DraftContext:
    tokens: torch.Tensor  # [B, T'] prompt + emitted tokens per row; row b is valid up to seq_lens[b] (root included)
    seq_lens: torch.Tensor  # [B] int64 known tokens per row, root included (the root sits at seq_lens - 1)
    roots: torch.Tensor  # [B] int64 last emitted token per row (= tokens[b, seq_lens[b] - 1])
    groups: torch.Tensor  # [B] int64 request index: rows with equal groups are siblings (same prompt)
    prompt_lens: torch.Tensor  # [B] int64
    active: torch.Tensor  # [B] bool; inactive rows (finished / bucket padding) may get any draft
    spec: SpecConfig  # shape of the draft: chain depth or tree depth / top-k / verify budget
    temperature: torch.Tensor  # [B] float32 target sampling settings (a sampling drafter should match them)
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    generator: torch.Generator  # the engine's generator (drafts must not peek at the verifier's randomness)


class Proposer(Protocol):
    def propose(self, ctx: DraftContext) -> DraftProposal: ...
