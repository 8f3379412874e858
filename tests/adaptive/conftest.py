"""Adaptive tests that run the engine use tiny random models on CPU with one torch thread (much faster for tiny
shapes on a shared 2-core machine); the thread count is restored afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
