"""`rollout.release_kv_for_update`: the rollout frees the engine's KV cache for each policy update and the
next rollout (training or validation) allocates it again. Releasing changes no math: two RL steps with validation in
between give exactly the metrics, samples, length histograms and weights of the same job with the switch off, and
report `perf/kv_released_gb` (the cache's size) and `timing_s/kv_restore`.

Run: python -m pytest tests/train/test_train_release_kv.py -q
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from worker.tlt.config import JobSpec
from worker.tlt.data.dataset import load_examples, split_examples
from worker.tlt.data.prompts import render_examples
from worker.tlt.model.load import load_model
from worker.tlt.rewards.registry import resolve
from worker.tlt.rl.engine_adapter import make_rollout
from worker.tlt.rl.trainer import GRPOTrainer

VOLATILE = ("timing_s/", "perf/")  # wall-clock metrics differ between any two runs
RELEASE_METRICS = ("perf/kv_released_gb", "timing_s/kv_restore")


def _two_steps(spec: JobSpec) -> tuple[list[Any], dict[str, torch.Tensor], list[bool], int]:
    """(per step: metrics, samples, histogram, validation metrics; final weights; released after each step; the
    cache's bytes at the end)."""
    model, tok = load_model(spec.model)
    train_rows, val_rows = split_examples(load_examples(spec.dataset), spec.dataset.validation_size)
    train = render_examples(train_rows, tok, None, spec.dataset.max_prompt_length)
    val = render_examples(val_rows, tok, None, spec.dataset.max_prompt_length)
    rollout = make_rollout(spec, model, tok, torch.device("cpu"))
    trainer = GRPOTrainer(spec, model, tok, rollout, train, resolve(["toy_count"]))
    record, released = [], []
    try:
        for _ in range(2):
            metrics, samples, hist = trainer.step()
            released.append(rollout.engine.released)
            record.append((metrics, samples, hist, trainer.validate(val)))  # validation allocates the cache again
    finally:
        trainer.close()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return record, weights, released, rollout.engine.cache.nbytes


def _stable(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if not k.startswith(VOLATILE)}


@pytest.mark.parametrize("speculative", ["off", "on"])
def test_release_for_update_changes_nothing_but_memory(toy_spec: Callable[..., JobSpec], speculative: str) -> None:
    rollout = {"speculative": speculative, "draft_depth": 3, "kv_cache_gb": 0.05}
    off = toy_spec(rollout=rollout, drafter={"kind": "ngram"})
    on = toy_spec(rollout={**rollout, "release_kv_for_update": True}, drafter={"kind": "ngram"})
    rec_off, w_off, released_off, _ = _two_steps(off)
    rec_on, w_on, released_on, cache_bytes = _two_steps(on)

    assert released_off == [False, False] and released_on == [True, True]
    for (m0, s0, h0, v0), (m1, s1, h1, v1) in zip(rec_off, rec_on, strict=True):
        assert _stable(m0) == _stable(m1)
        assert (s0, h0) == (s1, h1)
        assert _stable(v0) == _stable(v1)
        assert not any(k in m0 for k in RELEASE_METRICS)
        assert m1["perf/kv_released_gb"] == cache_bytes / 2**30 > 0
        assert m1["timing_s/kv_restore"] >= 0.0
    assert w_off.keys() == w_on.keys()
    assert all(torch.equal(w_off[k], w_on[k]) for k in w_off)
