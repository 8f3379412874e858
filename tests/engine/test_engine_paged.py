"""The engine on the paged KV layout (EngineConfig.page_size; rollout/paging.py): greedy decoding is token-identical
to the row layout's, with GRPO siblings sharing prompt pages, with continuous batching, and with a pool so small that
sequences are preempted (swapped out and back) mid-generation; speculative decoding (chain and tree) stays lossless
on pages under preemption; sampling with the same generator draws the same tokens on either layout while nothing is
preempted; admission refuses a sequence that could never fit.
Run: python -m pytest tests/engine/test_engine_paged.py -q"""

from __future__ import annotations

from typing import Any

import pytest

from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import Arm, chain_arm, tree_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.ngram import NGramProposer
from worker.tlt.speculative.proposers.protocol import Proposer
from worker.tlt.speculative.proposers.small_model import SmallModelProposer


def _requests(n: int, seed: int, new: int, samples: int = 1, temperature: float = 0.0) -> list[Request]:
    return [Request(p, RequestSampling(temperature=temperature, max_new_tokens=new + 3 * i, n=samples))
            for i, p in enumerate(random_prompts(n, seed=seed, hi=20))]


def _run(model: Any, reqs: list[Request], arm: Arm | None = None, proposer: Proposer | None = None,
         **cfg: Any) -> tuple[list[list[int]], Engine]:
    sd: dict[str, Any] = {} if arm is None or proposer is None else {"controller": AdaptiveSd.fixed(arm),
                                                                     "proposers": {arm.drafter: proposer}}
    engine = Engine(model, eos_ids=(257,), config=EngineConfig(max_len=96, sync_every=4, **cfg), **sd)
    out = engine.generate(reqs)
    if engine.state.pages is not None:  # every page back in the pool, counts consistent
        engine.state.pages.check()
        assert engine.state.pages.free == engine.state.pages.usable
    return [s.tokens for s in out.sequences], engine


def test_paged_greedy_equals_rows_with_shared_prompts_and_row_moves() -> None:
    model = tiny_target()
    reqs = _requests(5, seed=1, new=20, samples=2)  # 10 sequences, 4 rows: continuous batching
    rows, _ = _run(model, reqs, max_slots=4)
    for page in (4, 16):
        paged, eng = _run(model, reqs, max_slots=4, page_size=page)
        assert paged == rows
        assert eng.preemptions == 0  # as many pages as full rows would take


def test_preemption_keeps_greedy_identical() -> None:
    model = tiny_target()
    reqs = _requests(6, seed=2, new=30, samples=2)
    rows, _ = _run(model, reqs, max_slots=12)
    paged, eng = _run(model, reqs, max_slots=12, page_size=8, kv_pages=24)
    assert eng.preemptions > 0
    assert paged == rows


def test_sampling_on_pages_equals_rows_without_preemption() -> None:
    model = tiny_target()
    reqs = _requests(4, seed=3, new=16, samples=3, temperature=0.9)
    rows, _ = _run(model, reqs, max_slots=6, seed=11)
    paged, eng = _run(model, reqs, max_slots=6, page_size=8, seed=11)
    assert eng.preemptions == 0 and paged == rows


def test_sampling_under_preemption_finishes_every_sequence() -> None:
    model = tiny_target()
    reqs = _requests(4, seed=4, new=24, samples=3, temperature=0.9)
    paged, eng = _run(model, reqs, max_slots=12, page_size=8, kv_pages=20, seed=2)
    assert eng.preemptions > 0
    want = [r.params.max_new_tokens for r in reqs for _ in range(3)]
    assert all(len(t) == n or t[-1] == 257 for t, n in zip(paged, want, strict=True))  # full length or EOS


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_speculative_on_pages_under_preemption_equals_plain_rows(kind: str) -> None:
    if kind == "chain":
        model = tiny_target()
        reqs = _requests(4, seed=5, new=24, samples=2)
        arm, prop = chain_arm("small", 3), SmallModelProposer(perturbed_copy(model, noise=0.15))
    else:
        model = tiny_target("tiny-qwen2")
        reqs = [Request([5, 6, 7, 5, 6, 7, 5, 6] * 2, RequestSampling(temperature=0.0, max_new_tokens=30, n=3)),
                Request([9, 4, 9, 4, 9, 4], RequestSampling(temperature=0.0, max_new_tokens=26, n=2))]
        arm, prop = tree_arm("ngram", 2, 2, 5), NGramProposer()
    plain, _ = _run(model, reqs, max_slots=8)
    spec, eng = _run(model, reqs, arm, prop, max_slots=8, page_size=8, kv_pages=18)
    assert eng.preemptions > 0
    assert spec == plain


def test_a_sequence_larger_than_the_pool_is_refused() -> None:
    model = tiny_target()
    engine = Engine(model, eos_ids=(), config=EngineConfig(max_len=96, max_slots=4, page_size=8, kv_pages=6))
    with pytest.raises(ValueError, match="kv_pages"):
        engine.generate([Request([1, 2, 3], RequestSampling(max_new_tokens=60))])
