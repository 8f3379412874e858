"""Greedy speculative decoding is token-identical to plain greedy decoding for every sequence: random ragged
prompts, batch 1..16, chain k 1..8 and trees, a drafter that is often but not always right (partial acceptance and
KV roll-back), early EOS, continuous batching with more sequences than slots.
Run: python -m pytest tests/engine/test_engine_spec_greedy.py -q"""

from __future__ import annotations

from typing import Any

import pytest

from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import Arm, chain_arm, tree_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.ngram import NGramProposer
from worker.tlt.speculative.proposers.small_model import SmallModelProposer

TARGET = tiny_target()
DRAFTER = perturbed_copy(TARGET, noise=0.15)


def _run(reqs: list[Request], slots: int, arm: Arm | None, eos: tuple[int, ...] = (257,)):
    """Plain decoding (arm None) or SD with this one arm at every step."""
    sd: dict[str, Any] = {}
    if arm is not None:
        proposer = NGramProposer() if arm.drafter == "ngram" else SmallModelProposer(DRAFTER)
        sd = {"controller": AdaptiveSd.fixed(arm), "proposers": {arm.drafter: proposer}}
    engine = Engine(TARGET, eos_ids=eos, config=EngineConfig(max_len=96, max_slots=slots, sync_every=4), **sd)
    return engine.generate(reqs)


CASES = [
    (1, chain_arm("small", 1)),
    (2, chain_arm("small", 3)),
    (5, chain_arm("small", 5)),
    (16, chain_arm("small", 8)),
    (3, tree_arm("small", 3, 2, 6)),
    (8, tree_arm("small", 4, 3, 12)),
    (16, tree_arm("small", 2, 4, 9)),
]


@pytest.mark.parametrize(("batch", "arm"), CASES, ids=[f"b{b}-{a.name}" for b, a in CASES])
def test_spec_greedy_identical(batch: int, arm: Arm) -> None:
    prompts = random_prompts(batch, seed=batch + arm.depth)
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=16 + (i % 4) * 5)) for i, p in enumerate(prompts)]
    base = _run(reqs, slots=batch, arm=None)
    out = _run(reqs, slots=batch, arm=arm)
    _check(out, base, arm)


@pytest.mark.parametrize(("batch", "arm"), [(4, chain_arm("ngram", 6)), (12, tree_arm("ngram", 4, 2, 10))])
def test_spec_greedy_identical_ngram(batch: int, arm: Arm) -> None:
    prompts = random_prompts(batch, seed=batch)
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=30)) for p in prompts]
    _check(_run(reqs, batch, arm), _run(reqs, batch, None), arm)


def _check(out, base, arm: Arm) -> None:
    assert [s.tokens for s in out.sequences] == [s.tokens for s in base.sequences]
    assert [s.finish_reason for s in out.sequences] == [s.finish_reason for s in base.sequences]
    for a, b in zip(out.sequences, base.sequences, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    accepted = sum(st.accepted for st in out.steps)
    drafted = sum(st.active * arm.depth for st in out.steps if st.kind == "spec")
    # the drafter is right sometimes and wrong sometimes: both acceptance and roll-back were exercised
    assert 0 < accepted < drafted


def test_spec_greedy_early_eos_and_continuous_batching() -> None:
    prompts = random_prompts(9, seed=11)
    plain = _run([Request(p, RequestSampling(temperature=0.0, max_new_tokens=20)) for p in prompts], 9, None)
    eos = (plain.sequences[0].tokens[2], plain.sequences[1].tokens[5])  # EOS inside accepted runs
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=20, n=2)) for p in prompts]
    base = _run(reqs, slots=18, arm=None, eos=eos)
    out = _run(reqs, slots=4, arm=chain_arm("small", 4), eos=eos)  # 18 sequences through 4 slots
    assert [s.tokens for s in out.sequences] == [s.tokens for s in base.sequences]
    assert any(s.finish_reason == "stop" for s in out.sequences)
    assert all(len(s.tokens) <= 20 for s in out.sequences)
