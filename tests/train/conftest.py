"""Fixtures of the training-loop tests: `toy_spec(...)`, a JobSpec of the toy-count task on the tiny random Llama
(byte tokenizer), small enough for a step in well under a second on an idle CPU core."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from worker.tlt.config import JobSpec


def make_toy_spec(algorithm: dict[str, Any] | None = None, **top: Any) -> JobSpec:
    algo = {
        "num_generations": 4,
        "prompts_per_step": 2,
        "max_completion_length": 6,
        "learning_rate": 2e-2,
        "reward_funcs": ["toy_count"],
        **(algorithm or {}),
    }
    data = {
        "name": "toy",
        "model": {"builtin": "tiny-llama"},
        "dataset": {"builtin": "toy-count", "system_prompt": None, "validation_size": 4, "max_prompt_length": 64},
        "algorithm": algo,
        "rollout": {"speculative": "off", "kv_cache_gb": 0.05},
        "max_steps": 3,
        "save_steps": 2,
        **top,
    }
    return JobSpec.model_validate(data)


@pytest.fixture
def toy_spec() -> Callable[..., JobSpec]:
    return make_toy_spec
