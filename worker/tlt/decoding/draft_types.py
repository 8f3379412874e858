"""The one structure a drafter hands the verifier, and what the verifier hands back.

Chain drafts are trees whose every node has one child, so both shapes share `DraftProposal`:
node 0 of each row is the *root* (the last emitted token, already known to the target); nodes 1..N-1 are drafted
tokens, each with a parent index < its own. A chain of k tokens has N = k + 1 and parents [-1, 0, 1, ..., k-1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftProposal:
    tokens: torch.Tensor  # [B, N] int64; column 0 = root (last emitted token); padded nodes hold any id
    parents: torch.Tensor  # [B, N] int64; parents[:, 0] = -1; a padded node has parent -1 and counts[b] excludes it
    counts: torch.Tensor  # [B] int64; number of valid nodes per row, root included (>= 1)
    draft_probs: torch.Tensor | None = None  # [B, N, V] drafter's processed distribution that sampled node i's
    # *children* (row i = q(. | path to i)); None for deterministic drafters (n-gram, greedy top-k trees)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])


@dataclass(frozen=True)
class VerifyResult:
    """Per sequence: the emitted run = accepted draft tokens followed by one recovered-or-bonus token."""

    tokens: torch.Tensor  # [B, D+1] emitted tokens, left-aligned; entries past num_emitted[b] are padding
    num_emitted: torch.Tensor  # [B] int64 in 1..D+1 (before EOS / max_new_tokens truncation by the engine)
    accepted_nodes: torch.Tensor  # [B, D+1] node index (into the proposal) of each accepted draft token, -1 pad;
    # the engine keeps these nodes' KV entries and rolls back the rest
    logprobs: torch.Tensor  # [B, D+1] target log-prob (processed distribution) of each emitted token
