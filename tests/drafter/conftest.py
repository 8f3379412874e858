"""Shared fixtures for the drafter tests: a tiny random target and its own greedy continuations with hidden states."""

from __future__ import annotations

import pytest
import torch

from worker.tlt.model import preset, random_model
from worker.tlt.model.transformer import Transformer


@pytest.fixture(scope="session")
def tiny_target() -> Transformer:
    torch.manual_seed(0)
    # 4 layers so EAGLE-3's feature layers (2, L//2, L-3) exist; std 0.2 gives peaked, input-dependent greedy outputs
    return random_model(preset("tiny-llama", n_layers=4), seed=1, std=0.2)


def greedy_rollout(target: Transformer, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:  # [B, P] -> [B, P+N]
    seq = prompts
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = target(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


@pytest.fixture(scope="session")
def tiny_rollouts(tiny_target: Transformer) -> torch.Tensor:  # [16, 8 + 40]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (16, 8), generator=g)
    return greedy_rollout(tiny_target, prompts, 40)
