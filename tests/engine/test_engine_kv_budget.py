"""How the rollout engine's KV budget is chosen from the job spec (job_spec_translate.kv_budget / engine_config): an
explicit `rollout.kv_cache_gb` wins; unset, a CUDA device's free memory is planned (model/memory_plan.py), here
with a fake free-memory figure; unset on CPU, the budget is CPU_KV_CACHE_GB as before.
Run: python -m pytest tests/engine/test_engine_kv_budget.py -q"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worker.tlt.config import CPU_KV_CACHE_GB, JobSpec
from worker.tlt.decoding.kv_cache import slots_for_budget
from worker.tlt.job_spec_translate import KV_SLACK, engine_config, kv_budget, max_len
from worker.tlt.model.load import load_model
from worker.tlt.model.memory_plan import plan_kv

GIB = 2**30


def _spec(**rollout: Any) -> JobSpec:
    return JobSpec.model_validate({
        "name": "kv-budget",
        "model": {"builtin": "tiny-llama"},
        "dataset": {"builtin": "toy-count", "max_prompt_length": 64},
        "algorithm": {"num_generations": 4, "prompts_per_step": 8, "max_completion_length": 64,
                      "reward_funcs": ["toy_count"]},
        "rollout": rollout,
    })


@pytest.fixture(scope="module")
def model() -> Any:
    return load_model(_spec().model, "cpu")[0]


def test_unset_budget_is_planned_from_free_memory(model: Any) -> None:
    spec, cols = _spec(), max_len(_spec()) + KV_SLACK
    want = spec.algorithm.prompts_per_step * spec.algorithm.num_generations
    row = plan_kv(model.args, cols, free_bytes=64 * GIB, dtype_bytes=4, max_batch=want, max_slots=1).cache_bytes
    reserve = plan_kv(model.args, cols, free_bytes=64 * GIB, dtype_bytes=4, max_batch=want).reserved_bytes
    # room for 5 rows after the working memory: 5 slots, 5 rows' bytes
    free = int((reserve + 5.5 * row) / 0.9)
    slots, gb = kv_budget(spec, model.args, torch.float32, free)
    assert slots == 5 and gb == pytest.approx(5 * row / GIB)
    # plenty of memory: every sequence of the step, no more
    slots, gb = kv_budget(spec, model.args, torch.float32, 64 * GIB)
    assert slots == want and gb == pytest.approx(want * row / GIB)


def test_explicit_budget_wins_over_free_memory(model: Any) -> None:
    spec = _spec(kv_cache_gb=0.001)
    fit = slots_for_budget(model.args, max_len(spec) + KV_SLACK, 0.001, torch.float32)
    assert 1 <= fit < 32
    assert kv_budget(spec, model.args, torch.float32, 64 * GIB) == (fit, 0.001)


def test_too_little_free_memory_is_a_clear_error(model: Any) -> None:
    with pytest.raises(ValueError, match="kv_cache_gb unset: no KV-cache row"):
        kv_budget(_spec(), model.args, torch.float32, 1 << 20)


def test_cpu_default_is_unchanged(model: Any) -> None:
    assert _spec().rollout.kv_cache_gb is None
    unset, explicit = engine_config(_spec(), model), engine_config(_spec(kv_cache_gb=CPU_KV_CACHE_GB), model)
    assert unset == explicit and unset.kv_cache_gb == CPU_KV_CACHE_GB and unset.max_slots == 32


def test_paged_spec_sizes_a_pool_of_pages(model: Any) -> None:
    from worker.tlt.decoding.kv_cache import pages_for_budget
    from worker.tlt.model.memory_plan import plan_pages

    cfg = engine_config(_spec(kv_page_size=16, kv_cache_gb=0.01), model)
    assert cfg.page_size == 16 and cfg.max_slots == 32  # every sequence of the step a row; admission by pages
    assert cfg.kv_pages == pages_for_budget(model.args, 16, 0.01, torch.float32)
    # planned from free memory: the pages of what the row plan would have spent on rows of the longest sequence
    pages = plan_pages(model.args, 16, max_len(_spec()) + KV_SLACK, free_bytes=64 * GIB, dtype_bytes=4)
    rows = plan_kv(model.args, max_len(_spec()) + KV_SLACK, free_bytes=64 * GIB, dtype_bytes=4)
    assert pages * 16 >= rows.slots * (max_len(_spec()) + KV_SLACK)
    with pytest.raises(ValueError, match="no sequence"):
        plan_pages(model.args, 16, 4096, free_bytes=1 << 20, dtype_bytes=4)
