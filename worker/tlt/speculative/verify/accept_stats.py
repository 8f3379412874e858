"""Acceptance statistics of speculative steps, kept apart from logging.

The engine's speculative step calls `add` with the host-side counts of its one packed read; `observe_step` (tensors of
one verify) and `observe` (a proposal and its verify result) reduce to the same counts and read them back (a sync).
The rollout reports `as_metrics()` under the names of worker/tlt/metric_catalog.py (`sd/accept_len`,
`sd/accept_rate_pos_k`, ...), and the adaptive controller may read `mean_accept_len` per bucket.

Definitions, per sequence and verify step: `accepted` = draft tokens accepted (0..depth), `emitted` = accepted + 1
(the recovered or bonus token); the acceptance rate at draft position k (1-based) is P(accepted >= k | the draft had
a node at depth k), the per-position rate vLLM reports for chains, and for trees the same rate over tree depth.

Run the tests: `python -m pytest tests/spec/test_spec_stats.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from worker.tlt.decoding.draft_types import DraftProposal, VerifyResult
from worker.tlt.speculative.proposers.draft_tree import node_depths, valid_nodes


@dataclass
class AcceptanceStats:
    """Running totals over verify steps (reset by creating a new one), on the host."""

    steps: int = 0  # verify calls observed
    sequence_steps: int = 0  # sequence-steps (rows verified, summed over steps)
    _accepted: int = 0  # accepted draft tokens
    _verify_nodes: int = 0  # nodes sent to the target (root included)
    _drafted_at: list[int] = field(default_factory=list)  # [D] rows that drafted a k-th token
    _accepted_at: list[int] = field(default_factory=list)  # [D] rows that accepted >= k tokens

    def add(self, rows: int, accepted_at: Sequence[int], drafted_at: Sequence[int], verify_nodes: int) -> None:
        """One verify step: `rows` sequences, accepted_at[k-1] / drafted_at[k-1] = rows that accepted / drafted a
        k-th token, `verify_nodes` nodes sent (roots included)."""
        width = max(len(self._drafted_at), len(drafted_at), len(accepted_at))
        self._drafted_at = _summed(self._drafted_at, drafted_at, width)
        self._accepted_at = _summed(self._accepted_at, accepted_at, width)
        self.sequence_steps += int(rows)
        self._accepted += int(sum(accepted_at))  # sum over k of (rows with >= k accepted) = accepted tokens
        self._verify_nodes += int(verify_nodes)
        self.steps += 1

    def observe_step(
        self,
        draft_depth: torch.Tensor,  # [B] int64 depth of each row's draft (0 = nothing drafted)
        num_accepted: torch.Tensor,  # [B] int64 accepted draft tokens per row (before EOS truncation)
        verify_nodes: torch.Tensor | None = None,  # [B] int64 nodes verified per row (root included)
        max_depth: int | None = None,  # an upper bound on draft_depth (e.g. N-1); None takes the deepest draft
    ) -> None:
        """The same from one verify's tensors (reads them back: one sync)."""
        depth = draft_depth.to(torch.int64).cpu()
        acc = num_accepted.to(torch.int64).cpu()
        if max_depth is None:
            max_depth = int(depth.max()) if depth.numel() else 0
        positions = torch.arange(1, max_depth + 1)  # [D]
        nodes = (depth + 1).sum() if verify_nodes is None else verify_nodes.cpu().sum()
        self.add(depth.numel(), (acc[:, None] >= positions).sum(0).tolist(),
                 (depth[:, None] >= positions).sum(0).tolist(), int(nodes))

    def observe(self, proposal: DraftProposal, result: VerifyResult) -> None:
        """Convenience: the same from a proposal and its verify result."""
        depth = node_depths(proposal.parents).masked_fill(~valid_nodes(proposal.counts, proposal.num_nodes), 0)
        self.observe_step(depth.max(dim=1).values, result.num_emitted - 1, proposal.counts, proposal.num_nodes - 1)

    @property
    def mean_accept_len(self) -> float:
        """Mean tokens emitted per sequence per verify step (accepted + 1); 0 before any step."""
        return self._accepted / self.sequence_steps + 1.0 if self.sequence_steps else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per sequence per verify step."""
        return self._accepted / self.sequence_steps if self.sequence_steps else 0.0

    @property
    def tokens_per_verify_node(self) -> float:
        """Emitted tokens per node sent to the target (the verify budget's efficiency)."""
        if self._verify_nodes == 0:
            return 0.0
        return self.mean_accept_len * self.sequence_steps / self._verify_nodes

    def acceptance_per_position(self) -> list[float]:
        """[D] P(accepted >= k | drafted depth >= k) for k = 1..D, D = deepest position ever drafted."""
        deepest = max((k + 1 for k, n in enumerate(self._drafted_at) if n > 0), default=0)
        return [a / max(d, 1) for a, d in zip(self._accepted_at[:deepest], self._drafted_at[:deepest], strict=True)]

    def as_metrics(self, prefix: str = "sd/") -> dict[str, float]:
        out = {f"{prefix}accept_len": self.mean_accept_len, f"{prefix}verify_steps": float(self.steps)}
        for k, rate in enumerate(self.acceptance_per_position(), start=1):
            out[f"{prefix}accept_rate_pos_{k}"] = rate
        return out


def _summed(a: Sequence[int], b: Sequence[int], width: int) -> list[int]:  # elementwise sum, zero-padded to width
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(width)]
