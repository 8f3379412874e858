"""GPU checks of the paged KV layout (marked `gpu`: never run by CI). On an H200:
    python -m pytest tests/engine/test_engine_paged_gpu.py -m gpu -q -s
- SmolLM2 bf16 with CUDA graphs and the fused kernels compiled: greedy decoding on pages of 16 and 256 columns is
  token-identical to the row layout (the same kernels and batch shapes: the block table changes addresses only), and
  with a pool small enough to preempt sequences (swapped out and back bit for bit), still identical;
- a small-model chain and an n-gram tree speculative rollout on pages under preemption: token-identical to the same
  rollout on rows (the identical-token fraction against plain greedy is bf16's, as tests/engine/test_engine_gpu.py);
- sampled decoding on pages without preemption equals rows for the same seed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worker.tlt.bench import chat_prompts, gsm8k_questions
from worker.tlt.config import ModelSource
from worker.tlt.model.load import load_model
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm, tree_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.ngram import NGramProposer
from worker.tlt.speculative.proposers.small_model import SmallModelProposer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def smollm2():
    return load_model(ModelSource(builtin="smollm2-135m-instruct", dtype="bfloat16"), "cuda")


def _run(model: Any, tok: Any, reqs: list[Request], sd: dict[str, Any] | None = None,
         **cfg: Any) -> tuple[list[list[int]], Engine]:
    engine = Engine(model, eos_ids=tok.eos_ids, config=EngineConfig(max_len=512, **cfg), **(sd or {}))
    return [s.tokens for s in engine.generate(reqs).sequences], engine


def _reqs(tok: Any, n: int, temperature: float = 0.0, samples: int = 1) -> list[Request]:
    prompts = chat_prompts(tok, gsm8k_questions("gsm8k", n))
    return [Request(p, RequestSampling(temperature=temperature, max_new_tokens=160, n=samples)) for p in prompts]


def test_paged_greedy_equals_rows_with_and_without_preemption(smollm2) -> None:
    model, tok = smollm2
    reqs = _reqs(tok, 8, samples=2)
    rows, _ = _run(model, tok, reqs, max_slots=16)
    for page in (16, 256):
        paged, eng = _run(model, tok, reqs, max_slots=16, page_size=page)
        assert eng.step.fused and eng.preemptions == 0
        assert paged == rows, f"page {page}"
    tight, eng = _run(model, tok, reqs, max_slots=16, page_size=16, kv_pages=16 * 9)
    print(f"preempted {eng.preemptions}")
    assert eng.preemptions > 0 and tight == rows


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_paged_speculative_under_preemption_equals_rows(smollm2, kind: str) -> None:
    model, tok = smollm2
    reqs = _reqs(tok, 6)

    def sd() -> dict[str, Any]:
        if kind == "chain":
            arm, prop = chain_arm("small", 4), SmallModelProposer(perturbed_copy(model, noise=0.1))
        else:
            arm, prop = tree_arm("ngram", 2, 3, 8), NGramProposer()
        return {"controller": AdaptiveSd.fixed(arm), "proposers": {arm.drafter: prop}}

    rows, _ = _run(model, tok, reqs, sd(), max_slots=6)
    paged, eng = _run(model, tok, reqs, sd(), max_slots=6, page_size=16, kv_pages=16 * 4)
    print(f"{kind}: preempted {eng.preemptions}")
    assert eng.preemptions > 0 and paged == rows


def test_paged_sampling_equals_rows_without_preemption(smollm2) -> None:
    model, tok = smollm2
    reqs = _reqs(tok, 6, temperature=1.0, samples=2)
    rows, _ = _run(model, tok, reqs, max_slots=12, seed=3)
    paged, eng = _run(model, tok, reqs, max_slots=12, page_size=64, seed=3)
    assert eng.preemptions == 0 and paged == rows
