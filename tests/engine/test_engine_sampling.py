"""Sampling in the engine: a fixed seed reproduces the rollout exactly, another seed changes it; the emitted tokens
follow the exact processed target distribution (chi-square, plain and speculative), and the same test rejects
samples from a wrong temperature (so it can fail). The hidden-state hook sees every cached position.
Run: python -m pytest tests/engine/test_engine_sampling.py -q"""

from __future__ import annotations

import torch

from worker.tlt.model.args import preset
from worker.tlt.model.load import random_model
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.selfcheck import sampling_check
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.small_model import SmallModelProposer


def _rollout(seed: int, spec: bool) -> list[list[int]]:
    target = tiny_target()
    reqs = [Request(p, RequestSampling(temperature=0.9, top_p=0.95, max_new_tokens=12, n=3))
            for p in random_prompts(4, seed=2)]
    engine = Engine(target, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=5, seed=seed),
                    controller=AdaptiveSd.fixed(chain_arm("small", 3)) if spec else None,
                    proposers={"small": SmallModelProposer(perturbed_copy(target, 0.15))})
    return [s.tokens for s in engine.generate(reqs).sequences]


def test_fixed_generator_reproduces() -> None:
    for spec in (False, True):
        a, b, c = _rollout(0, spec), _rollout(0, spec), _rollout(1, spec)
        assert a == b
        assert a != c


def test_emitted_tokens_follow_the_exact_distribution() -> None:
    small = random_model(preset("tiny-qwen2", vocab_size=10, eos_token_ids=()), seed=4, std=0.3)
    res = sampling_check(small, perturbed_copy(small, 0.5), [3, 1, 4], samples=3000,
                         settings=[(1.0, 1.0, 0), (0.8, 0.9, 4)], slots=3000)
    assert res["sampling_pvalue_min"] > 1e-4, res
    assert res["negative_control_pvalue"] < 1e-4, res  # the test has power: a wrong temperature is caught


def test_hidden_hook_sees_every_cached_position() -> None:
    target = tiny_target()
    seen: list[tuple[tuple[int, int], int, torch.Tensor]] = []

    def hook(seqs, toks, hidden) -> None:
        assert hidden.shape == (len(seqs), target.args.dim) and toks.shape == (len(seqs),)
        seen.extend(zip(seqs, toks.tolist(), hidden, strict=True))

    prompts = random_prompts(3, seed=9)
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=8)) for p in prompts]
    for ctl in (None, AdaptiveSd.fixed(chain_arm("small", 3))):
        seen.clear()
        engine = Engine(target, eos_ids=(), config=EngineConfig(max_len=48, max_slots=2), controller=ctl,
                        proposers={"small": SmallModelProposer(perturbed_copy(target, 0.15))}, hidden_hook=hook)
        out = engine.generate(reqs)
        for s in out.sequences:
            full = prompts[s.request] + s.tokens
            mine = [(t, h) for (seq, t, h) in seen if seq == (s.request, 0)]
            # every token whose K/V entered the cache: the prompt and all emitted tokens but the last
            assert [t for t, _ in mine] == full[:-1]
            with torch.no_grad():
                _, ref, _ = target.forward_hidden(torch.tensor([full[:-1]]))
            torch.testing.assert_close(torch.stack([h for _, h in mine]), ref[0], atol=1e-4, rtol=1e-4)
