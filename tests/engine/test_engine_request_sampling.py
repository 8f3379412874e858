"""A request's sampling settings travel in one form: the job spec's algorithm fields -> `RequestSampling`
(job_spec_translate.request_sampling, greedy = the same with temperature 0) -> per row, the request's own object on the
host (EngineState.row_sampling) and its fields in RowState's tensors (the sampler's RowSampling); the batch's mode and
the drafters' filters are derived from the host rows.
Run: python -m pytest tests/engine/test_engine_request_sampling.py -q"""

from __future__ import annotations

from dataclasses import replace

import torch

from worker.tlt.config import preset
from worker.tlt.decoding.sampling import DraftFilters
from worker.tlt.job_spec_translate import request_sampling
from worker.tlt.rollout.decode_step import MIXED, Mode
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import random_prompts, tiny_target
from worker.tlt.rollout.speculative_step import row_filters
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling


def test_request_sampling_is_the_specs_algorithm_settings() -> None:
    spec = preset("demo-cpu")
    spec = spec.model_copy(update={"algorithm": spec.algorithm.model_copy(update={"top_p": 0.9, "top_k": 40})})
    a = spec.algorithm
    got = request_sampling(spec, n=4)
    assert got == RequestSampling(temperature=a.temperature, top_p=0.9, top_k=40,
                                  max_new_tokens=a.max_completion_length, n=4)
    assert got.temperature > 0.0
    assert request_sampling(spec, greedy=True) == replace(got, n=1, temperature=0.0) == replace(got, n=1).greedy()


def test_prefill_keeps_each_rows_request_settings_on_host_and_device() -> None:
    model = tiny_target()
    engine = Engine(model, eos_ids=(), config=EngineConfig(max_len=48, max_slots=4))
    hot = RequestSampling(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=6)
    cold = RequestSampling(temperature=0.0, max_new_tokens=5)
    prompts = random_prompts(2, seed=3)
    reqs = [Request(prompts[0], hot), Request(prompts[1], cold)]
    engine.prefill([(0, 0), (1, 0), (0, 1)], reqs)
    s = engine.state
    assert [id(p) for p in s.row_sampling] == [id(hot), id(cold), id(hot)]  # the request's own object, no copy
    assert s.rows.temp[:3].tolist() == torch.tensor([0.7, 0.0, 0.7]).tolist()
    assert s.rows.top_p[:3].tolist() == torch.tensor([0.9, 1.0, 0.9]).tolist()
    assert s.rows.top_k[:3].tolist() == [20, 0, 20]
    assert s.mode == MIXED
    assert row_filters(s.row_sampling) == DraftFilters(-1, True, -1.0)
    # one setting for every row: a uniform mode carrying it, and the filters a drafter can take as numbers
    engine2 = Engine(model, eos_ids=(), config=EngineConfig(max_len=48, max_slots=4))
    engine2.prefill([(0, 0), (0, 1)], [Request(prompts[0], hot)])
    assert engine2.state.mode == Mode("uniform", 0.7, 0.9, 20)
    assert row_filters(engine2.state.row_sampling) == DraftFilters(20, True, 0.7)
