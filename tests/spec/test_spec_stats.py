"""AcceptanceStats: accept length and per-position acceptance from verify results.

Run: python -m pytest tests/spec/test_spec_stats.py -q
"""

from __future__ import annotations

import math

import torch

from worker.tlt.speculative.proposers.draft_tree import chain_proposal
from worker.tlt.speculative.verify.accept_stats import AcceptanceStats
from worker.tlt.speculative.verify.verifier import verify_greedy


def test_observe_step_counts() -> None:
    stats = AcceptanceStats()
    assert stats.mean_accept_len == 0.0 and stats.acceptance_per_position() == []
    stats.observe_step(torch.tensor([3, 3, 2, 0]), torch.tensor([3, 1, 0, 0]))
    stats.observe_step(torch.tensor([4]), torch.tensor([2]))
    assert stats.steps == 2 and stats.sequence_steps == 5
    assert math.isclose(stats.mean_accept_len, 1 + 6 / 5)
    # position 1: drafted by 4 rows, accepted by 3; position 2: 4 / 2; position 3: 3 / 1; position 4: 1 / 0
    assert stats.acceptance_per_position() == [3 / 4, 2 / 4, 1 / 3, 0.0]
    m = stats.as_metrics()
    assert m["sd/accept_len"] == stats.mean_accept_len and m["sd/accept_rate_pos_2"] == 0.5
    assert math.isclose(stats.tokens_per_verify_node, (5 + 6) / (4 + 4 + 3 + 1 + 5))


def test_observe_from_proposal_and_result() -> None:
    logits = torch.randn(3, 4, 9)
    target = logits.argmax(-1)
    drafts = target[:, :3].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % 9  # row 1 accepts 1 draft
    prop = chain_proposal(torch.zeros(3, dtype=torch.int64), drafts, num_drafts=torch.tensor([3, 3, 0]))
    res = verify_greedy(prop, logits)
    stats = AcceptanceStats()
    stats.observe(prop, res)
    assert stats.acceptance_per_position() == [1.0, 0.5, 0.5]
    assert math.isclose(stats.mean_accept_len, 1 + (3 + 1 + 0) / 3)
