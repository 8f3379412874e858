"""Greedy speculative decoding is token-identical to plain greedy decoding for every sequence: random ragged
prompts, batch 1..16, chain k 1..8 and trees, a drafter that is often but not always right (partial acceptance and
KV roll-back), early EOS, continuous batching with more sequences than slots.
Run: python -m pytest tests/engine/test_engine_spec_greedy.py -q"""

from __future__ import annotations

import pytest

from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, SamplingParams, SpecConfig
from worker.tlt.spec.ngram import NGramConfig, NGramProposer
from worker.tlt.spec.small_model import SmallModelConfig, SmallModelProposer

TARGET = tiny_target()
DRAFTER = perturbed_copy(TARGET, noise=0.15)


def _run(reqs: list[Request], slots: int, spec: SpecConfig | None, eos: tuple[int, ...] = (257,), ngram: bool = False):
    proposer = None
    if spec is not None:
        topk = spec.topk if spec.method == "tree" else 1
        proposer = (NGramProposer(NGramConfig(topk=topk)) if ngram
                    else SmallModelProposer(DRAFTER, SmallModelConfig(topk=topk)))
    engine = Engine(TARGET, eos_ids=eos, config=EngineConfig(max_len=96, max_slots=slots, sync_every=4),
                    spec=spec, proposer=proposer)
    return engine.generate(reqs)


CASES = [
    (1, SpecConfig("on", "chain", depth=1)),
    (2, SpecConfig("on", "chain", depth=3)),
    (5, SpecConfig("on", "chain", depth=5)),
    (16, SpecConfig("on", "chain", depth=8)),
    (3, SpecConfig("on", "tree", depth=3, topk=2, verify_tokens=6)),
    (8, SpecConfig("on", "tree", depth=4, topk=3, verify_tokens=12)),
    (16, SpecConfig("on", "tree", depth=2, topk=4, verify_tokens=9)),
]


@pytest.mark.parametrize(("batch", "spec"), CASES, ids=[f"b{b}-{s.method}{s.depth}x{s.topk}" for b, s in CASES])
def test_spec_greedy_identical(batch: int, spec: SpecConfig) -> None:
    prompts = random_prompts(batch, seed=batch + spec.depth)
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=16 + (i % 4) * 5)) for i, p in enumerate(prompts)]
    base = _run(reqs, slots=batch, spec=None)
    out = _run(reqs, slots=batch, spec=spec)
    _check(out, base, spec)


@pytest.mark.parametrize(("batch", "spec"), [(4, SpecConfig("on", "chain", depth=6)),
                                             (12, SpecConfig("on", "tree", depth=4, topk=2, verify_tokens=10))])
def test_spec_greedy_identical_ngram(batch: int, spec: SpecConfig) -> None:
    prompts = random_prompts(batch, seed=batch)
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=30)) for p in prompts]
    _check(_run(reqs, batch, spec, ngram=True), _run(reqs, batch, None), spec)


def _check(out, base, spec: SpecConfig) -> None:
    assert [s.tokens for s in out.sequences] == [s.tokens for s in base.sequences]
    assert [s.finish_reason for s in out.sequences] == [s.finish_reason for s in base.sequences]
    for a, b in zip(out.sequences, base.sequences, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    accepted = sum(st.accepted for st in out.steps)
    drafted = sum(st.active * spec.depth for st in out.steps if st.kind == "spec")
    # the drafter is right sometimes and wrong sometimes: both acceptance and roll-back were exercised
    assert 0 < accepted < drafted


def test_spec_greedy_early_eos_and_continuous_batching() -> None:
    prompts = random_prompts(9, seed=11)
    plain = _run([Request(p, SamplingParams(temperature=0.0, max_new_tokens=20)) for p in prompts], 9, None)
    eos = (plain.sequences[0].tokens[2], plain.sequences[1].tokens[5])  # EOS inside accepted runs
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=20, n=2)) for p in prompts]
    base = _run(reqs, slots=18, spec=None, eos=eos)
    out = _run(reqs, slots=4, spec=SpecConfig("on", "chain", depth=4), eos=eos)  # 18 sequences through 4 slots
    assert [s.tokens for s in out.sequences] == [s.tokens for s in base.sequences]
    assert any(s.finish_reason == "stop" for s in out.sequences)
    assert all(len(s.tokens) <= 20 for s in out.sequences)
