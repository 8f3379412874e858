"""Fixtures of the training-loop tests: `toy_spec(...)`, tests/specs.py's toy-count job on the tiny random Llama."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.specs import toy_spec as shared_toy_spec
from worker.tlt.config import JobSpec


def make_toy_spec(algorithm: dict[str, Any] | None = None, **top: Any) -> JobSpec:
    """tests/specs.py's toy spec, with the algorithm fields a training test varies most as its first argument."""
    return shared_toy_spec(algorithm=algorithm or {}, **top)


@pytest.fixture
def toy_spec() -> Callable[..., JobSpec]:
    return make_toy_spec
