"""Job specs the tests share, each a small dict that a test deep-merges its own fields into (a section given as a
dict updates that section's fields; any other value replaces the field):

- `toy_spec(...)`: a training job of the toy-count task on the tiny random Llama (byte tokenizer), small enough for
  an RL step in well under a second on an idle CPU core; `toy_spec_dict(...)` is its dict.
- `api_spec(...)`: the smallest job an API test submits (the control plane validates and stores it; nothing trains).

Tests import them as `from tests.specs import toy_spec` (pytest runs with --import-mode=importlib from the repo root).
"""

from __future__ import annotations

import copy
from typing import Any

from worker.tlt.config import JobSpec

TOY: dict[str, Any] = {
    "name": "toy",
    "model": {"builtin": "tiny-llama"},
    "dataset": {"builtin": "toy-count", "system_prompt": None, "validation_size": 4, "max_prompt_length": 64},
    "algorithm": {"num_generations": 4, "prompts_per_step": 2, "max_completion_length": 6, "learning_rate": 2e-2,
                  "reward_funcs": ["toy_count"]},
    "rollout": {"speculative": "off", "kv_cache_gb": 0.05},
    "max_steps": 3,
    "save_steps": 2,
}

API: dict[str, Any] = {
    "model": {"builtin": "tiny-llama"},
    "algorithm": {"max_completion_length": 8},
    "dataset": {"builtin": "toy-count"},
}


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of `base` with `over` merged in: dicts into dicts at any depth, anything else replacing."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def toy_spec_dict(**over: Any) -> dict[str, Any]:
    return merged(TOY, over)


def toy_spec(**over: Any) -> JobSpec:
    return JobSpec.model_validate(toy_spec_dict(**over))


def api_spec(**over: Any) -> dict[str, Any]:
    return merged(API, over)
