"""Acceptance statistics of speculative steps, kept apart from logging.

The engine calls `observe_step` after each verify (tensors stay on their device; nothing syncs until a value is
read); the rollout reports `as_metrics()` under DESIGN.md's names (`sd/accept_len`, `sd/accept_rate_pos_k`, ...),
and the adaptive controller may read `mean_accept_len` per bucket.

Definitions, per sequence and verify step: `accepted` = draft tokens accepted (0..depth), `emitted` = accepted + 1
(the recovered or bonus token); the acceptance rate at draft position k (1-based) is P(accepted >= k | the draft had
a node at depth k), the per-position rate vLLM reports for chains, and for trees the same rate over tree depth.

Run the tests: `python -m pytest tests/spec/test_spec_stats.py -q`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .tree import node_depths, valid_nodes
from .types import DraftProposal, VerifyResult


@dataclass
class AcceptanceStats:
    """Running totals over verify steps (reset by creating a new one)."""

    steps: int = 0  # verify calls observed
    _rows: torch.Tensor | None = None  # () sequence-steps
    _accepted: torch.Tensor | None = None  # () accepted draft tokens
    _verify_nodes: torch.Tensor | None = None  # () nodes sent to the target (root included)
    _drafted_at: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [D] rows w/ depth k
    _accepted_at: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [D] accepted >= k

    def observe_step(
        self,
        draft_depth: torch.Tensor,  # [B] int64 depth of each row's draft (0 = nothing drafted)
        num_accepted: torch.Tensor,  # [B] int64 accepted draft tokens per row (before EOS truncation)
        verify_nodes: torch.Tensor | None = None,  # [B] int64 nodes verified per row (root included)
        max_depth: int | None = None,  # an upper bound on draft_depth (e.g. N-1); None reads it (one host sync)
    ) -> None:
        device = draft_depth.device
        depth = draft_depth.to(torch.int64)
        acc = num_accepted.to(device=device, dtype=torch.int64)
        if max_depth is None:
            max_depth = int(depth.max().item()) if depth.numel() else 0
        width = max(int(self._drafted_at.numel()), max_depth)
        positions = torch.arange(1, width + 1, device=device)  # [D]
        drafted = (depth.unsqueeze(1) >= positions).sum(dim=0)  # [D]
        accepted = (acc.unsqueeze(1) >= positions).sum(dim=0)  # [D]
        self._drafted_at = _grow(self._drafted_at, width, device) + drafted
        self._accepted_at = _grow(self._accepted_at, width, device) + accepted
        rows = torch.tensor(depth.numel(), device=device)
        self._rows = rows if self._rows is None else self._rows.to(device) + rows
        total_acc = acc.sum()
        self._accepted = total_acc if self._accepted is None else self._accepted.to(device) + total_acc
        nodes = (depth + 1).sum() if verify_nodes is None else verify_nodes.to(device).sum()
        self._verify_nodes = nodes if self._verify_nodes is None else self._verify_nodes.to(device) + nodes
        self.steps += 1

    def add(self, rows: int, accepted_at: Sequence[int], drafted_at: Sequence[int], verify_nodes: int) -> None:
        """One verify step from host counts (the engine's packed read): `rows` active sequences, accepted_at[k-1] /
        drafted_at[k-1] = rows that accepted / drafted a k-th token, `verify_nodes` nodes sent (roots included)."""
        width = max(int(self._drafted_at.numel()), len(drafted_at))
        dev = self._drafted_at.device
        self._drafted_at = _grow(self._drafted_at, width, dev) + _grow(torch.tensor(drafted_at, dtype=torch.int64),
                                                                      width, dev)
        self._accepted_at = _grow(self._accepted_at, width, dev) + _grow(torch.tensor(accepted_at, dtype=torch.int64),
                                                                        width, dev)
        self._rows = torch.tensor(rows) + (0 if self._rows is None else self._rows.cpu())
        acc = torch.tensor(sum(accepted_at))  # sum over k of (rows with >= k accepted) = accepted tokens
        self._accepted = acc + (0 if self._accepted is None else self._accepted.cpu())
        self._verify_nodes = torch.tensor(verify_nodes) + (0 if self._verify_nodes is None else self._verify_nodes.cpu())
        self.steps += 1

    def observe(self, proposal: DraftProposal, result: VerifyResult) -> None:
        """Convenience: the same from a proposal and its verify result."""
        depth = node_depths(proposal.parents).masked_fill(~valid_nodes(proposal.counts, proposal.num_nodes), 0)
        self.observe_step(depth.max(dim=1).values, result.num_emitted - 1, proposal.counts, proposal.num_nodes - 1)

    @property
    def sequence_steps(self) -> int:
        return 0 if self._rows is None else int(self._rows.item())

    @property
    def mean_accept_len(self) -> float:
        """Mean tokens emitted per sequence per verify step (accepted + 1); 0 before any step."""
        n = self.sequence_steps
        return 0.0 if n == 0 or self._accepted is None else float(self._accepted.item()) / n + 1.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per sequence per verify step."""
        n = self.sequence_steps
        return 0.0 if n == 0 or self._accepted is None else float(self._accepted.item()) / n

    @property
    def tokens_per_verify_node(self) -> float:
        """Emitted tokens per node sent to the target (the verify budget's efficiency)."""
        if self._verify_nodes is None or int(self._verify_nodes.item()) == 0:
            return 0.0
        return self.mean_accept_len * self.sequence_steps / float(self._verify_nodes.item())

    def acceptance_per_position(self) -> list[float]:
        """[D] P(accepted >= k | drafted depth >= k) for k = 1..D, D = deepest position ever drafted."""
        drafted = self._drafted_at.double().cpu()
        accepted = self._accepted_at.double().cpu()
        deepest = int((drafted > 0).nonzero().max().item()) + 1 if bool((drafted > 0).any()) else 0
        return (accepted[:deepest] / drafted[:deepest].clamp_min(1)).tolist()

    def as_metrics(self, prefix: str = "sd/") -> dict[str, float]:
        out = {f"{prefix}accept_len": self.mean_accept_len, f"{prefix}verify_steps": float(self.steps)}
        for k, rate in enumerate(self.acceptance_per_position(), start=1):
            out[f"{prefix}accept_rate_pos_{k}"] = rate
        return out


def _grow(t: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:  # [D'] -> [width] zero-padded
    t = t.to(device)
    if t.numel() >= width:
        return t
    return torch.cat([t, torch.zeros(width - t.numel(), dtype=t.dtype, device=device)])
