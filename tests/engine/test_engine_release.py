"""Releasing the engine's KV cache for the policy update (rollout/memory.py): after release + restore the
engine generates exactly what a fresh engine with the same seed generates (greedy, sampled, and greedy SD with a
small-model drafter whose own cache goes too); a released engine refuses to generate; the cache tensors are empty
while released; both calls are idempotent. GPU (marked `gpu`): the allocated memory drops by at least the cache's
bytes, and a graphed decode after restore equals the eager one.

Run: python -m pytest tests/engine/test_engine_release.py -q   (GPU part: -m gpu)
"""

from __future__ import annotations

import pytest
import torch

from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, GenerationOutput, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.small_model import SmallModelProposer

EOS = (257,)


def _requests(temperature: float, n: int = 1, seed: int = 3) -> list[Request]:
    return [Request(p, RequestSampling(temperature=temperature, max_new_tokens=5 + 2 * i, n=n))
            for i, p in enumerate(random_prompts(4, seed=seed))]


def _engine(model: Transformer, **kw: object) -> Engine:
    cfg = {"max_len": 48, "max_slots": 3, "seed": 11, **kw}
    return Engine(model, eos_ids=EOS, config=EngineConfig(**cfg))  # type: ignore[arg-type]


def _outputs(out: GenerationOutput) -> list[tuple[list[int], list[float], str]]:
    return [(s.tokens, s.logprobs, s.finish_reason) for s in out.sequences]


def test_greedy_after_release_and_restore_equals_a_fresh_engine() -> None:
    model = tiny_target()
    engine = _engine(model)
    first = engine.generate(_requests(0.0))
    nbytes = engine.cache.nbytes
    k0 = engine.cache.k[0]
    assert nbytes > 0 and not engine.released

    assert engine.release_memory() == nbytes  # no graphs off CUDA: the cache is all there is
    assert engine.released
    assert all(t.numel() == 0 for t in (*engine.cache.k, *engine.cache.v))
    assert engine.step.cache is engine.cache  # the decode step sees the release (no stale reference to the tensors)
    assert engine.cache.nbytes == 0
    assert engine.release_memory() == 0  # idempotent
    with pytest.raises(RuntimeError, match="restore_memory"):
        engine.generate(_requests(0.0))

    engine.restore_memory()
    restored = list(engine.cache.k)
    engine.restore_memory()  # idempotent: nothing re-allocated
    assert all(a is b for a, b in zip(restored, engine.cache.k, strict=True))
    assert not engine.released and engine.cache.nbytes == nbytes
    assert engine.cache.k[0].shape == k0.shape and engine.slots == 3

    again = engine.generate(_requests(0.0))
    fresh = _engine(model).generate(_requests(0.0))
    assert _outputs(again) == _outputs(fresh) == _outputs(first)


def test_sampled_after_release_and_restore_equals_a_fresh_engine_with_the_same_seed() -> None:
    model = tiny_target()
    engine = _engine(model)
    engine.generate(_requests(1.0, n=2))  # moves the generator and leaves stale K/V behind
    engine.release_memory()
    engine.restore_memory()
    engine.gen.manual_seed(11)  # the stream continues across a release; rewind it to compare with a fresh engine
    got = engine.generate(_requests(1.0, n=2))
    want = _engine(model).generate(_requests(1.0, n=2))
    assert _outputs(got) == _outputs(want)


def test_small_model_drafter_cache_goes_too_and_sd_output_is_unchanged() -> None:
    target = tiny_target()
    drafter = perturbed_copy(target, 0.3)

    def make() -> tuple[Engine, SmallModelProposer]:
        prop = SmallModelProposer(drafter)
        return Engine(target, eos_ids=EOS, config=EngineConfig(max_len=48, max_slots=3, seed=11),
                      controller=AdaptiveSd.fixed(chain_arm("small", 3)), proposers={"small": prop}), prop

    engine, prop = make()
    engine.generate(_requests(0.0))
    assert prop.cache is not None
    draft_bytes, cache_bytes = prop.cache.nbytes, engine.cache.nbytes
    assert engine.release_memory() == cache_bytes + draft_bytes
    assert prop.cache is None
    engine.restore_memory()
    got = engine.generate(_requests(0.0, seed=4))
    fresh, _ = make()
    assert _outputs(got) == _outputs(fresh.generate(_requests(0.0, seed=4)))
    assert any(s.kind == "spec" for s in got.steps)


def test_release_refused_while_sequences_are_active() -> None:
    engine = _engine(tiny_target(), sync_every=1)
    errors: list[str] = []

    def on_finish(_: object) -> None:  # the first sequence to finish: the others are still decoding
        if not errors:
            with pytest.raises(RuntimeError, match="active") as e:
                engine.release_memory()
            errors.append(str(e.value))

    engine.generate(_requests(0.0), on_finish=on_finish)
    assert errors and not engine.released


# ------------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_release_frees_the_cache_and_graphs_come_back_identical() -> None:
    model = tiny_target().cuda()
    engine = _engine(model, max_slots=64, max_len=256)
    assert engine.graphs is not None
    reqs = _requests(1.0, n=4)
    engine.generate(reqs)  # captures decode graphs
    assert len(engine.graphs) > 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    reserved_before = torch.cuda.memory_reserved()
    nbytes = engine.cache.nbytes
    freed = engine.release_memory()
    after = torch.cuda.memory_allocated()
    print(f"cache {nbytes / 2**20:.1f} MiB, freed {freed / 2**20:.1f} MiB, allocated -{(before - after) / 2**20:.1f}"
          f" MiB, reserved -{(reserved_before - torch.cuda.memory_reserved()) / 2**20:.1f} MiB")
    assert freed >= nbytes
    assert before - after >= nbytes
    engine.restore_memory()
    assert engine.graphs is not None and len(engine.graphs) == 0  # captured again on first use
    engine.gen.manual_seed(11)
    graphed = engine.generate(reqs)
    assert len(engine.graphs) > 0
    eager = _engine(model, max_slots=64, max_len=256, cuda_graphs=False).generate(reqs)
    assert [s.tokens for s in graphed.sequences] == [s.tokens for s in eager.sequences]
    for g, e in zip(graphed.sequences, eager.sequences, strict=True):
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
