"""The engine's plain greedy decoding equals a naive full-recompute decoder, with ragged prompts, early EOS,
continuous batching (more sequences than slots), several samples per prompt and any sync interval.
Run: python -m pytest tests/engine/test_engine_greedy_plain.py -q"""

from __future__ import annotations

import pytest
import torch

from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import naive_greedy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize(("slots", "sync_every"), [(3, 1), (16, 5)])
def test_plain_greedy_matches_naive(arch: str, slots: int, sync_every: int) -> None:
    model = tiny_target(arch)
    prompts = random_prompts(7, seed=3)
    eos = (257,)
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=6 + 3 * i)) for i, p in enumerate(prompts)]
    engine = Engine(model, eos_ids=eos, config=EngineConfig(max_len=64, max_slots=slots, sync_every=sync_every))
    out = engine.generate(reqs)
    assert [(s.request, s.sample) for s in out.sequences] == [(i, 0) for i in range(7)]
    for s, r in zip(out.sequences, reqs, strict=True):
        ref = naive_greedy(model, r.prompt, r.params.max_new_tokens, eos)
        assert s.tokens == ref
        assert s.finish_reason == ("stop" if ref[-1] in eos else "length")
        # greedy log-probs are log_softmax of the target logits
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([r.prompt + ref]))[0], -1)
        exp = [float(lp[len(r.prompt) - 1 + j, t]) for j, t in enumerate(ref)]
        assert s.logprobs == pytest.approx(exp, abs=1e-4)
    assert engine.n_active == 0
    # the stats say how many tokens were emitted
    assert sum(st.emitted for st in out.steps) == out.tokens


def test_early_eos_and_samples_per_prompt() -> None:
    model = tiny_target()
    prompts = random_prompts(4, seed=5)
    refs = [naive_greedy(model, p, 12, ()) for p in prompts]
    eos = (refs[0][3],)  # a token the first sequence emits early
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=12, n=3, eos_ids=eos)) for p in prompts]
    out = Engine(model, eos_ids=(257,), config=EngineConfig(max_len=48, max_slots=5, sync_every=2)).generate(reqs)
    assert len(out.sequences) == 12
    for s in out.sequences:
        ref = naive_greedy(model, prompts[s.request], 12, eos)
        assert s.tokens == ref
    first = [s for s in out.sequences if s.request == 0]
    assert all(s.finish_reason == "stop" and len(s.tokens) <= 4 for s in first)


def test_prompt_too_long_is_refused() -> None:
    engine = Engine(tiny_target(), eos_ids=(257,), config=EngineConfig(max_len=16, max_slots=2))
    with pytest.raises(ValueError, match="max_len"):
        engine.generate([Request([1] * 10, RequestSampling(max_new_tokens=10))])
