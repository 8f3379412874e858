"""Fixtures of the fused-kernel tests. The CPU tests run the kernels in Triton's interpreter, which tests/conftest.py
switches on before anything imports triton. One process runs either the interpreter or real GPU kernels, so the
interpreter is on unless the run selects the GPU tests (`-m gpu`):
    python -m pytest tests/kernels -q                 # CPU tests (interpreter)
    python -m pytest tests/kernels -m gpu -q -s       # GPU tests (compiled kernels; an H200)
Tiny models on one torch thread (as tests/conftest.py does for the engine folders).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
