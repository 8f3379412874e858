"""The plain decode step body (rollout/decode_step.py) and what the engine caches around it, on CPU: the sampling
mode of a batch, a mixed batch (greedy rows stay greedy), the compiled body (dynamo + functionalised mutation,
`aot_eager` backend) emits the same tokens as the eager one with the same seed, the lazily kept attention bound,
the row-state snapshot, and the finish callback of `Engine.generate`.
Run: python -m pytest tests/engine/test_engine_decode_step.py -q"""

from __future__ import annotations

import pytest
import torch

from worker.tlt.rollout.decode_step import GREEDY, MIXED, DecodeStep, Mode, sampling_mode
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import naive_greedy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling, SequenceResult


def test_sampling_mode() -> None:
    def rows(*settings: tuple[float, float, int]) -> list[RequestSampling]:  # the processing fields only differ
        return [RequestSampling(temperature=t, top_p=p, top_k=k, max_new_tokens=8 + i)
                for i, (t, p, k) in enumerate(settings)]

    assert sampling_mode(rows((0.0, 1.0, 0), (0.0, 0.5, 3))) == GREEDY
    assert sampling_mode(rows((1.0, 1.0, 50), (1.0, 1.0, 50))) == Mode("uniform", 1.0, 1.0, 50)
    assert sampling_mode(rows((1.0, 1.0, 50), (0.0, 1.0, 50))) == MIXED
    assert sampling_mode(rows((1.0, 1.0, 50), (1.0, 0.9, 50))) == MIXED


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    model = tiny_target()
    prompts = random_prompts(3, seed=11)
    reqs = [Request(prompts[0], RequestSampling(temperature=0.0, max_new_tokens=10, eos_ids=())),
            Request(prompts[1], RequestSampling(temperature=0.8, top_p=0.9, max_new_tokens=10, eos_ids=())),
            Request(prompts[2], RequestSampling(temperature=1.0, top_k=5, max_new_tokens=10, eos_ids=()))]
    engine = Engine(model, eos_ids=(), config=EngineConfig(max_len=48, max_slots=3, sync_every=3))
    out = engine.generate(reqs)
    assert out.sequences[0].tokens == naive_greedy(model, prompts[0], 10, ())
    with torch.no_grad():  # greedy rows report log_softmax of the target, not log(one-hot) = 0
        lp = torch.log_softmax(model(torch.tensor([prompts[0] + out.sequences[0].tokens]))[0], -1)
    exp = [float(lp[len(prompts[0]) - 1 + j, t]) for j, t in enumerate(out.sequences[0].tokens)]
    assert out.sequences[0].logprobs == pytest.approx(exp, abs=1e-4)
    # the top-k row only ever emits one of its 5 most likely tokens (its log-probs are finite)
    assert all(x > float("-inf") for x in out.sequences[2].logprobs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_step_emits_the_eager_tokens(temperature: float) -> None:
    model = tiny_target()
    reqs = [Request(p, RequestSampling(temperature=temperature, top_k=20, max_new_tokens=9, n=2))
            for p in random_prompts(2, seed=4)]
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        engine = Engine(model, eos_ids=(257,), config=EngineConfig(max_len=48, max_slots=4, seed=7))
        if compiled:  # what EngineConfig.compile does on CUDA, with a backend that needs no C++ toolchain
            engine.state.step = DecodeStep(model, engine.cache, engine.rows, compile_max_batch=4,
                                           compiler="aot_eager")
        out = engine.generate(reqs)
        runs.append([(s.tokens, s.logprobs) for s in out.sequences])
    assert runs[0] == runs[1]


def test_attention_bound_follows_plain_steps() -> None:
    model = tiny_target()
    prompts = random_prompts(3, seed=2)
    engine = Engine(model, eos_ids=(), config=EngineConfig(max_len=40, max_slots=3))
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=20)) for p in prompts]
    engine.prefill([(i, 0) for i in range(3)], reqs)
    for _ in range(5):
        engine.decode_step(3)
    # while no row hit its budget the bound is exact: cached tokens (the next step attends up to it + 1)
    assert engine.state.row_hi[:3].tolist() == engine.rows.lens[:3].tolist()
    assert engine.state.active_hi() == int(engine.rows.lens[:3].max())
    engine.state.row_hi[0] += 30  # a speculative step writes into the array: the cached maximum must follow
    assert engine.state.active_hi() == int(engine.rows.lens[0]) + 30


def test_row_state_snapshot_restores_in_place() -> None:
    engine = Engine(tiny_target(), eos_ids=(), config=EngineConfig(max_len=32, max_slots=2))
    prompts = random_prompts(2, seed=1)
    engine.prefill([(0, 0), (1, 0)], [Request(p, RequestSampling(max_new_tokens=8)) for p in prompts])
    st = engine.rows
    before = [t.clone() for t in st.tensors()]
    ptrs = [t.data_ptr() for t in st.tensors()]
    saved = st.snapshot()
    engine.decode_step(2)
    assert not torch.equal(st.lens, before[0])
    st.restore(saved)
    assert all(torch.equal(a, b) for a, b in zip(st.tensors(), before, strict=True))
    assert [t.data_ptr() for t in st.tensors()] == ptrs


def test_on_finish_called_once_per_sequence_as_it_leaves() -> None:
    model = tiny_target()
    prompts = random_prompts(5, seed=6)
    reqs = [Request(p, RequestSampling(temperature=1.0, max_new_tokens=3 + 4 * i, n=2, eos_ids=()))
            for i, p in enumerate(prompts)]
    engine = Engine(model, eos_ids=(), config=EngineConfig(max_len=64, max_slots=4, sync_every=2))
    seen: list[tuple[SequenceResult, int]] = []
    out = engine.generate(reqs, on_finish=lambda r: seen.append((r, engine.n_active)))
    assert sorted((r.request, r.sample) for r, _ in seen) == [(s.request, s.sample) for s in out.sequences]
    assert {(r.request, r.sample): r for r, _ in seen} == {(s.request, s.sample): s for s in out.sequences}
    # short sequences are reported while longer ones still decode (not all at the end)
    assert seen[0][0].request == 0 and seen[0][1] > 0
    assert len(seen[0][0].tokens) == 3
