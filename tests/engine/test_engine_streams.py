"""Per-sequence random streams (decoding/streams.py): a sampled sequence's tokens depend on its own seed and sample
index only -- not on the batch it shares steps with, not on preemption (swapped out and back on a tiny page pool),
not on the path (torch or the fused kernels in Triton's interpreter) -- and speculative decoding (chain with a
sampling drafter, tree with the n-gram drafter) is as batch-independent. Same seed, same tokens; different requests,
siblings or engine seeds, different streams. The hash's draws are uniform / Exp(1) and keyed on every field.
Run: python -m pytest tests/engine/test_engine_streams.py -q"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from worker.tlt.decoding import streams
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling, SequenceResult
from worker.tlt.speculative.arm import Arm, chain_arm, tree_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.ngram import NGramProposer
from worker.tlt.speculative.proposers.protocol import Proposer
from worker.tlt.speculative.proposers.small_model import SmallModelProposer

MODEL = tiny_target()
Out = dict[tuple[int, int], tuple[list[int], list[float]]]


def _run(reqs: list[Request], arm: Arm | None = None, proposer: Proposer | None = None, model: Any = MODEL,
         **cfg: Any) -> tuple[list[SequenceResult], Engine]:
    sd: dict[str, Any] = {} if arm is None or proposer is None else {"controller": AdaptiveSd.fixed(arm),
                                                                     "proposers": {arm.drafter: proposer}}
    config = EngineConfig(**{"max_len": 96, "sync_every": 3, "max_slots": 8, **cfg})
    engine = Engine(model, eos_ids=(257,), config=config, **sd)
    return engine.generate(reqs).sequences, engine


def _seeded(n: int, seed: int, new: int = 18, samples: int = 2, temperature: float = 1.0,
            top_k: int = 0) -> list[Request]:
    """n requests with their own seeds (100 + i) and different lengths."""
    return [Request(p, RequestSampling(temperature=temperature, top_k=top_k, max_new_tokens=new + 3 * i, n=samples,
                                       seed=100 + i))
            for i, p in enumerate(random_prompts(n, seed=seed, hi=20))]


def _by_seed(seqs: list[SequenceResult], reqs: list[Request]) -> Out:
    """Results keyed by (request seed, sample): the sequence's identity whatever its index in the call."""
    return {(reqs[s.request].params.seed or 0, s.sample): (s.tokens, s.logprobs) for s in seqs}


def _subset(got: Out, want: Out) -> None:
    for k, v in want.items():
        assert got[k][0] == v[0], k
        assert got[k][1] == pytest.approx(v[1], abs=1e-5), k


def test_a_sequence_samples_the_same_alone_or_in_any_batch() -> None:
    reqs = _seeded(5, seed=1)
    alone = {}
    for r in (reqs[3], reqs[0]):
        seqs, _ = _run([r])
        alone.update(_by_seed(seqs, [r]))
    batched, _ = _run(reqs, max_slots=4)  # continuous batching: rows move, buckets pad
    shuffled = [reqs[4], reqs[0], reqs[2], reqs[3], reqs[1]]
    reordered, _ = _run(shuffled, max_slots=8)
    _subset(_by_seed(batched, reqs), alone)
    assert _by_seed(reordered, shuffled).keys() == _by_seed(batched, reqs).keys()
    _subset(_by_seed(reordered, shuffled), _by_seed(batched, reqs))


def test_mixed_settings_and_top_k_rows_keep_their_streams() -> None:
    reqs = _seeded(4, seed=2, top_k=5)
    hot = [dataclasses.replace(reqs[1], params=dataclasses.replace(reqs[1].params, temperature=0.7, top_k=0))]
    alone, _ = _run(reqs[:1])
    mixed, _ = _run(reqs[:1] + hot + reqs[2:])  # MIXED mode: per-row settings
    _subset(_by_seed(mixed, reqs[:1] + hot + reqs[2:]), _by_seed(alone, reqs[:1]))


@pytest.mark.parametrize("fused", [False, True])
def test_sampling_under_preemption_equals_the_unpreempted_run(fused: bool) -> None:
    """On the fused path (Triton's interpreter: slow) one small case."""
    reqs = _seeded(2, seed=4, new=10, samples=2) if fused else _seeded(3, seed=4, new=24, samples=2)
    rows, _ = _run(reqs, fused_kernels=fused)
    paged, eng = _run(reqs, fused_kernels=fused, page_size=8, kv_pages=7 if fused else 16)
    assert eng.preemptions > 0
    assert eng.step.commits_fused is fused  # the fused sampler (kernels/sample_commit.py) committed the tokens
    got, want = _by_seed(paged, reqs), _by_seed(rows, reqs)
    assert got.keys() == want.keys()
    _subset(got, want)


def test_fused_sampler_equals_torch_path() -> None:
    reqs = _seeded(2, seed=5, new=8, samples=2, top_k=20)
    torch_path, _ = _run(reqs, fused_kernels=False)
    fused_path, eng = _run(reqs, fused_kernels=True)
    assert eng.step.samples_fused(eng.state.mode, 4)
    _subset(_by_seed(fused_path, reqs), _by_seed(torch_path, reqs))


def test_sampled_chain_speculation_is_batch_independent_and_survives_preemption() -> None:
    reqs = _seeded(4, seed=6, new=20, samples=2)

    def spec(rs: list[Request], **cfg: Any) -> tuple[Out, Engine]:
        prop = SmallModelProposer(perturbed_copy(MODEL, noise=0.15))  # samples its drafts (chain, T > 0)
        seqs, eng = _run(rs, chain_arm("small", 3), prop, **cfg)
        return _by_seed(seqs, rs), eng

    alone, _ = spec(reqs[2:3])
    batched, eng = spec(reqs)
    assert eng.state.accept_stats.steps > 0
    _subset(batched, alone)
    paged, eng = spec(reqs, page_size=8, kv_pages=18)
    assert eng.preemptions > 0
    _subset(paged, batched)


def test_sampled_tree_speculation_is_batch_independent() -> None:
    model = tiny_target("tiny-qwen2")
    reqs = [Request([5, 6, 7, 5, 6, 7, 5, 6] * 2, RequestSampling(temperature=0.8, max_new_tokens=24, n=2, seed=1)),
            Request([9, 4, 9, 4, 9, 4], RequestSampling(temperature=0.8, max_new_tokens=20, n=3, seed=2))]
    arm = tree_arm("ngram", 2, 2, 5)
    alone, _ = _run(reqs[1:], arm, NGramProposer(), model=model)
    both, _ = _run(reqs, arm, NGramProposer(), model=model)
    _subset(_by_seed(both, reqs), _by_seed(alone, reqs[1:]))


def test_same_seed_same_tokens_and_distinct_streams() -> None:
    prompt = random_prompts(1, seed=7, hi=12)[0]
    params = RequestSampling(temperature=1.0, max_new_tokens=24, n=3)
    unseeded = [Request(prompt, params), Request(prompt, params)]  # the same prompt twice: two requests
    a, _ = _run(unseeded, seed=3)
    b, _ = _run(unseeded, seed=3)
    c, _ = _run(unseeded, seed=4)
    toks = [s.tokens for s in a]
    assert toks == [s.tokens for s in b]  # same engine seed, same tokens
    assert toks != [s.tokens for s in c]  # another engine seed, another draw
    assert len({tuple(t) for t in toks}) == len(toks)  # siblings and the repeated request all differ
    own = [Request(prompt, dataclasses.replace(params, seed=9))]
    x, _ = _run(own, seed=3)
    y, _ = _run(own, seed=4)
    assert [s.tokens for s in x] == [s.tokens for s in y]  # a request's own seed overrides the engine's


def test_successive_generates_draw_fresh_streams_from_the_generator() -> None:
    reqs = [Request(p, RequestSampling(temperature=1.0, max_new_tokens=16)) for p in random_prompts(2, seed=8)]
    engine = Engine(MODEL, eos_ids=(257,), config=EngineConfig(max_len=64, max_slots=4, seed=5))
    state = engine.gen.get_state()
    first = [s.tokens for s in engine.generate(reqs).sequences]
    second = [s.tokens for s in engine.generate(reqs).sequences]
    assert first != second
    engine.gen.set_state(state)  # what a checkpoint restores
    assert [s.tokens for s in engine.generate(reqs).sequences] == first


# ----------------------------------------------------------------------------------------------------- the hash
def test_hash_draws_are_uniform_exponential_and_keyed_on_every_field() -> None:
    keys = torch.tensor([streams.sequence_key(s, i) for s in (0, 1) for i in (0, 1)], dtype=torch.int64)
    pos = torch.zeros(4, dtype=torch.int64)
    u = streams.row_uniforms(keys, pos, streams.ACCEPT, 100_000)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert u.mean(1).sub(0.5).abs().max() < 0.005 and u.var(1).sub(1 / 12).abs().max() < 0.002
    e = streams.row_exponentials(keys, pos, streams.SAMPLE, 100_000)
    assert float(e.min()) > 0.0 and e.mean(1).sub(1.0).abs().max() < 0.02 and e.var(1).sub(1.0).abs().max() < 0.05
    hist = torch.histc(u.flatten(), bins=20, min=0.0, max=1.0) / u.numel()  # flat within 4 sigma
    assert (hist - 0.05).abs().max() < 4 * (0.05 * 0.95 / u.numel()) ** 0.5
    # pairwise uncorrelated across sequences, positions and purposes
    others = [streams.row_uniforms(keys, pos + 1, streams.ACCEPT, 100_000),
              streams.row_uniforms(keys, pos, streams.RESIDUAL, 100_000)]
    for v in [*others, u.roll(1, 0)]:
        corr = ((u - 0.5) * (v - 0.5)).mean() * 12
        assert abs(float(corr)) < 0.01
    # a pure function: the same inputs give the same bits, a row's draws do not depend on the other rows or on n
    assert torch.equal(streams.row_uniforms(keys[2:3], pos[2:3], streams.ACCEPT, 50), u[2:3, :50])


def test_host_and_device_hash_agree() -> None:
    xs = [0, 1, -1, 12345, 2**62 + 7, -(2**63)]
    got = streams.mix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    want = [streams.mix64_int(x) for x in xs]
    assert [g & streams.MASK64 for g in got] == want
