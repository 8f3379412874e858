"""Shared fixtures for the drafter tests: a tiny random target and its own greedy continuations with hidden states."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import torch

from worker.tlt.model import preset, random_model
from worker.tlt.model.transformer import Transformer
from worker.tlt.speculative.drafter.buffer import HiddenStateBuffer
from worker.tlt.speculative.drafter.model import EagleDrafter


@pytest.fixture(scope="session")
def tiny_target(one_thread: Callable[[], AbstractContextManager[None]]) -> Transformer:
    torch.manual_seed(0)
    # 4 layers so EAGLE-3's feature layers (2, L//2, L-3) exist; std 0.15 gives varied, input-dependent greedy outputs
    # (std 0.1 mostly repeats one token, which a drafter predicts trivially)
    with one_thread():
        return random_model(preset("tiny-llama", n_layers=4), seed=1, std=0.15)


def greedy_rollout(target: Transformer, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:  # [B, P] -> [B, P+N]
    seq = prompts
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = target(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


@pytest.fixture(scope="session")
def tiny_rollouts(tiny_target: Transformer,
                  one_thread: Callable[[], AbstractContextManager[None]]) -> torch.Tensor:  # [16, 8 + 40]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (16, 8), generator=g)
    with one_thread():
        return greedy_rollout(tiny_target, prompts, 40)


def fill_buffer(buffer: HiddenStateBuffer, drafter: EagleDrafter, target: Transformer, seqs: torch.Tensor,
                prompt_len: int) -> None:
    """Teacher-forced rows (the last prompt position onwards) of each sequence, as the spot trainer stores them."""
    with torch.no_grad():
        _, h, cap = target.forward_hidden(seqs, layers=drafter.feature_layers)
    rows = h if drafter.cfg.kind == "eagle1" else torch.cat([drafter.features(h, cap), h], -1)
    for b in range(seqs.shape[0]):
        n = seqs.shape[1] - prompt_len + 1
        buffer.capture(torch.full((n,), b), seqs[b, prompt_len - 1:], rows[b, prompt_len - 1:])


@pytest.fixture
def filler():  # tests cannot import conftest under --import-mode=importlib; they get the helper as a fixture
    return fill_buffer
