"""GPU checks of the rollout engine (marked `gpu`: never run by CI). On an H200:
    python -m pytest tests/engine/test_engine_gpu.py -m gpu -q -s
- CUDA-graph decode equals eager decode token for token (same shapes, same kernels);
- greedy SD on CUDA fp32 (tiny model) is token-identical to plain greedy;
- SmolLM2 bf16: the identical-token fraction of greedy SD vs plain greedy on GSM8K prompts (printed; batch shapes
  change bf16 rounding, so a few late divergences are expected) must stay >= 0.9.
"""

from __future__ import annotations

import pytest
import torch

from worker.tlt.bench import chat_prompts, gsm8k_questions
from worker.tlt.config import ModelSource
from worker.tlt.model.load import load_model
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, SamplingParams, SpecConfig
from worker.tlt.spec.ngram import NGramProposer
from worker.tlt.spec.small_model import SmallModelProposer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _common_prefix_fraction(got: list[list[int]], want: list[list[int]]) -> float:
    common = total = 0
    for g, w in zip(got, want, strict=True):
        k = 0
        while k < min(len(g), len(w)) and g[k] == w[k]:
            k += 1
        common, total = common + k, total + len(w)
    return common / max(total, 1)


@pytest.fixture(scope="module")
def smollm2():
    return load_model(ModelSource(builtin="smollm2-135m-instruct", dtype="bfloat16"), "cuda")


def test_cuda_graph_decode_equals_eager(smollm2) -> None:
    model, tok = smollm2
    prompts = chat_prompts(tok, gsm8k_questions("gsm8k", 12))
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=64)) for p in prompts]
    outs = []
    for graphs in (False, True):
        cfg = EngineConfig(max_len=512, max_slots=12, cuda_graphs=graphs)
        engine = Engine(model, eos_ids=tok.eos_ids, config=cfg)
        outs.append([s.tokens for s in engine.generate(reqs).sequences])
        assert (engine.graphs is not None) == graphs and (not graphs or len(engine.graphs) > 0)
    assert outs[0] == outs[1]


def test_sampling_with_graphs_is_reproducible(smollm2) -> None:
    model, tok = smollm2
    prompts = chat_prompts(tok, gsm8k_questions("gsm8k", 4))
    reqs = [Request(p, SamplingParams(temperature=1.0, max_new_tokens=64, n=4)) for p in prompts]
    runs = [[s.tokens for s in Engine(model, eos_ids=tok.eos_ids, config=EngineConfig(max_len=512, max_slots=16,
                                                                                        seed=3)).generate(reqs).sequences]
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_spec_greedy_identical_fp32_cuda() -> None:
    target = tiny_target().cuda()
    drafter = perturbed_copy(target, 0.15)
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=24)) for p in random_prompts(16, seed=1)]
    base = Engine(target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=16)).generate(reqs)
    for spec, prop in [(SpecConfig("on", "chain", depth=4), SmallModelProposer(drafter)),
                       (SpecConfig("on", "tree", depth=3, topk=2, verify_tokens=8), NGramProposer())]:
        out = Engine(target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=16), spec=spec,
                     proposer=prop).generate(reqs)
        assert [s.tokens for s in out.sequences] == [s.tokens for s in base.sequences]


def test_bf16_identical_token_fraction_smollm2(smollm2) -> None:
    model, tok = smollm2
    prompts = chat_prompts(tok, gsm8k_questions("gsm8k", 32))
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=256)) for p in prompts]
    base = [s.tokens for s in Engine(model, eos_ids=tok.eos_ids, config=EngineConfig(max_len=768, max_slots=32))
            .generate(reqs).sequences]
    for name, spec, prop in [
        ("ngram-chain5", SpecConfig("on", "chain", depth=5), NGramProposer()),
        ("small-chain4", SpecConfig("on", "chain", depth=4), SmallModelProposer(perturbed_copy(model, 0.02))),
    ]:
        engine = Engine(model, eos_ids=tok.eos_ids, config=EngineConfig(max_len=768, max_slots=32), spec=spec,
                        proposer=prop)
        got = [s.tokens for s in engine.generate(reqs).sequences]
        frac = _common_prefix_fraction(got, base)
        identical = sum(g == w for g, w in zip(got, base, strict=True))
        print(f"{name}: identical sequences {identical}/{len(base)}, identical-token fraction {frac:.4f}, "
              f"mean accept len {engine.accept_stats.mean_accept_len:.2f}")
        assert frac >= 0.9
