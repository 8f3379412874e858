"""Fixtures of the fused-kernel tests. The CPU tests run the kernels in Triton's interpreter, which must be switched
on BEFORE `worker.tlt.kernels.forward` is imported (triton.jit reads TRITON_INTERPRET when it decorates): this
conftest is loaded before the test modules of this folder. One process runs either the interpreter or real GPU
kernels, so the interpreter is on unless the run selects the GPU tests on a CUDA machine:
    python -m pytest tests/kernels -q                 # CPU tests (interpreter)
    python -m pytest tests/kernels -m gpu -q -s       # GPU tests (compiled kernels; an H200)
Tiny models on one torch thread (as tests/conftest.py does for the engine folders).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    expr = config.getoption("markexpr") or ""
    gpu_run = torch.cuda.is_available() and "gpu" in expr and "not gpu" not in expr
    if not gpu_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
