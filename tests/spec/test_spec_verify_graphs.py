"""The graph-captured speculative step after the proposal (rollout/speculative_graphs.py over rollout/speculative_body.py):
static buffers, padded nodes, free pad rows, pre-drawn randomness.

- CPU: the graph path with an eager "replay" (same buffers, same padding, same K/V writes, same commit; only the
  capture is missing) gives greedy SD output token-identical to plain greedy decoding, with batch buckets wider than
  the active batch (free pad rows) and arm widths wider than the drafts (padded nodes), n-gram chains and small-model
  trees; and the sampled path (top-k 1: a deterministic sampler) equals plain greedy too;
- GPU (`-m gpu`): real CUDA graphs, tiny fp32 model: graphed verify == eager verify == plain greedy, token for
  token; SmolLM2 bf16: per-step time graphed vs eager and capture seconds / pool memory are printed.

Run: `python -m pytest tests/spec/test_spec_verify_graphs.py -q` (CPU) and, on a GPU machine,
`python -m pytest tests/spec/test_spec_verify_graphs.py -q -m gpu -s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from worker.tlt.rollout.decode_step import GREEDY, Mode
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.engine_state import EngineState
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.speculative_body import SpecOut
from worker.tlt.rollout.speculative_graphs import VerifyGraphs, _Entry
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import Arm, chain_arm, tree_arm
from worker.tlt.speculative.control import AdaptiveSd, BanditConfig, SwitchConfig, arms_table, make_bandit
from worker.tlt.speculative.proposers.ngram import NGramProposer
from worker.tlt.speculative.proposers.small_model import SmallModelProposer

TARGET = tiny_target()
DRAFTER = perturbed_copy(TARGET, noise=0.15)


class _EagerReplay:
    def __init__(self, entry: _Entry, body: Callable[[], SpecOut]) -> None:
        self.entry, self.body = entry, body

    def replay(self) -> None:
        self.entry.out = self.body()


class EagerVerifyGraphs(VerifyGraphs):
    """The graph path without CUDA: every "replay" runs the body on the static buffers."""

    def _record(self, state: EngineState, entry: _Entry, body: Callable[[], SpecOut]) -> None:
        entry.graph = _EagerReplay(entry, body)  # type: ignore[assignment]


def attach(eng: Engine, graphs: VerifyGraphs | None) -> None:
    """What the engine's graph set holds on CUDA (`Engine.graph_set.verify`, replayed by rollout/speculative_step.py)."""
    eng.graph_set.verify = graphs


def graphs_of(eng: Engine) -> VerifyGraphs:
    g = eng.verify_graphs
    assert g is not None
    return g


def run(model, reqs: list[Request], arm: Arm | None, proposer, slots: int, graphs: type | None,
        device: str = "cpu") -> tuple[list[list[int]], Engine]:
    sd: dict[str, Any] = {} if arm is None else {"controller": AdaptiveSd.fixed(arm), "proposers": {arm.drafter: proposer}}
    eng = Engine(model, eos_ids=(257,), config=EngineConfig(max_len=96, max_slots=slots, sync_every=4), **sd)
    attach(eng, graphs() if graphs is not None else None)  # None on CUDA too: the reference path stays eager
    return [s.tokens for s in eng.generate(reqs).sequences], eng


def proposer_for(drafter: str) -> NGramProposer | SmallModelProposer:
    return NGramProposer() if drafter == "ngram" else SmallModelProposer(DRAFTER)


CASES = [  # (sequences, slots, arm)
    (5, 16, chain_arm("ngram", 6)),  # bucket 8 > 5 active: free pad rows; short n-gram drafts
    (12, 12, chain_arm("small", 4)),  # continuous batching shrinks the batch inside a bucket
    (6, 8, tree_arm("small", 3, 2, 7)),
]


@pytest.mark.parametrize(("n", "slots", "arm"), CASES, ids=[c[2].name for c in CASES])
def test_graph_path_on_cpu_equals_plain_greedy(n: int, slots: int, arm: Arm) -> None:
    reqs = [Request(p * 2, RequestSampling(temperature=0.0, max_new_tokens=20 + 3 * i))
            for i, p in enumerate(random_prompts(n, seed=n))]
    prop = proposer_for(arm.drafter)
    plain, _ = run(TARGET, reqs, None, None, slots, None)
    graphed, eng = run(TARGET, reqs, arm, prop, slots, EagerVerifyGraphs)
    assert graphed == plain
    g = graphs_of(eng)
    assert len(g) >= 1 and all(k[1] == arm.verify_tokens for k in g.keys())  # one width per arm shape
    assert any(k[0] > 1 for k in g.keys())
    assert eng.accept_stats.steps > 0 and eng.accept_stats.mean_accept_len >= 1.0


@pytest.mark.parametrize(("n", "slots", "arm"), CASES, ids=[c[2].name for c in CASES])
def test_sampled_graph_path_with_top_k_1_equals_plain_greedy(n: int, slots: int, arm: Arm) -> None:
    """T=1 with top-k 1 samples deterministically (the target's argmax), through the sampled verifier: the static
    uniforms / noise buffers, padded rows and nodes, and the drafter's q (small model) must not change a token."""
    reqs = [Request(p * 2, RequestSampling(temperature=1.0, top_k=1, max_new_tokens=20 + 3 * i))
            for i, p in enumerate(random_prompts(n, seed=n + 1))]
    greedy = [Request(r.prompt, RequestSampling(temperature=0.0, max_new_tokens=r.params.max_new_tokens)) for r in reqs]
    prop = proposer_for(arm.drafter)
    plain, _ = run(TARGET, greedy, None, None, slots, None)
    graphed, eng = run(TARGET, reqs, arm, prop, slots, EagerVerifyGraphs)
    assert graphed == plain
    assert all(k[4] != GREEDY for k in graphs_of(eng).keys())


def test_warmup_captures_every_shape() -> None:
    """warmup() captures each (batch bucket, arm shape) ahead of time; the rollout then captures nothing new."""
    reqs = [Request(p * 2, RequestSampling(temperature=0.0, max_new_tokens=30 + 2 * i))
            for i, p in enumerate(random_prompts(6, seed=11))]
    plain, _ = run(TARGET, reqs, None, None, 8, None)
    eng = Engine(TARGET, eos_ids=(257,), config=EngineConfig(max_len=96, max_slots=8, sync_every=4),
                 controller=AdaptiveSd.fixed(chain_arm("ngram", 4)), proposers={"ngram": NGramProposer()})
    graphs = EagerVerifyGraphs()
    attach(eng, graphs)
    eng._warmup_verify(8, GREEDY)  # what Engine.warmup does on CUDA: one shape per batch bucket here
    captured = graphs.keys()
    assert {(k[0], k[1], k[2], k[3]) for k in captured} == {(b, 5, 4, 1) for b in (1, 2, 4, 8)}
    assert [s.tokens for s in eng.generate(reqs).sequences] == plain
    assert graphs.keys() == captured  # nothing captured during the rollout


def test_adaptive_warmup_captures_each_buckets_own_arms() -> None:
    """The adaptive engine's warm-up captures, per batch bucket, only the arms of the batches in that bucket (a wide
    small-batch tree is not captured at batch 32), a learned drafter's chains with its q in sampled modes and its
    trees without (top-k trees are deterministic drafts); a sampled rollout then captures nothing new."""
    table = arms_table(["ngram", "small"])
    ctl = AdaptiveSd(SwitchConfig(mode="adaptive", on_below=16), make_bandit(table, BanditConfig()))
    eng = Engine(TARGET, eos_ids=(257,), config=EngineConfig(max_len=96, max_slots=32),
                 controller=ctl, proposers={"ngram": NGramProposer(), "small": SmallModelProposer(DRAFTER)})
    graphs = EagerVerifyGraphs()
    attach(eng, graphs)
    mode = Mode("uniform", 1.0, 1.0, 0)
    eng._warmup_verify(32, mode)
    keys = graphs.keys()
    want = {(eng.state.bucket(n), a.verify_tokens, min(a.depth, a.verify_tokens - 1), a.topk,
             a.drafter != "ngram" and a.topk == 1)
            for n in range(1, 25) for a in ctl.arms_for(n) if a.is_sd}  # off_at default: 1.5 x on_below = 24
    assert {(k[0], k[1], k[2], k[3], k[5]) for k in keys} == want
    assert any(k[3] > 1 for k in keys)  # trees are among them
    widest = max(a.verify_tokens for a in ctl.arms_for(1))
    assert widest > max(a.verify_tokens for a in ctl.arms_for(24))
    assert not any(k[0] == eng.state.bucket(24) and k[1] == widest for k in keys)


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("arm", [tree_arm("small", 3, 2, 6), chain_arm("small", 3)], ids=lambda a: a.name)
def test_sampled_rollout_replays_what_warmup_captured(arm: Arm, top_k: int) -> None:
    """A learned drafter's chain sends q and its top-k tree does not: the warm-up captures each shape's verify graph
    as the rollout will replay it, so a sampled rollout captures nothing new (a capture at a 7B width: ~0.5 s)."""
    eng = Engine(TARGET, eos_ids=(257,), config=EngineConfig(max_len=96, max_slots=4),
                 controller=AdaptiveSd.fixed(arm), proposers={"small": SmallModelProposer(DRAFTER)})
    graphs = EagerVerifyGraphs()
    attach(eng, graphs)
    eng._warmup_verify(4, Mode("uniform", 1.0, 1.0, top_k))
    keys = graphs.keys()
    assert {k[5] for k in keys} == {arm.topk == 1}
    reqs = [Request(p * 2, RequestSampling(temperature=1.0, top_k=top_k, max_new_tokens=10 + 3 * i))
            for i, p in enumerate(random_prompts(4, seed=5))]
    out = eng.generate(reqs)
    assert any(s.kind == "spec" for s in out.steps)
    assert graphs.keys() == keys  # nothing captured during the rollout


# ---- GPU ------------------------------------------------------------------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("drafter", ["ngram", "small"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_verify_equals_eager(drafter: str) -> None:
    target = tiny_target().to("cuda").float()
    small = perturbed_copy(target, noise=0.15)
    reqs = [Request(p * 2, RequestSampling(temperature=0.0, max_new_tokens=20 + 3 * i))  # prompt + new <= max_len 96
            for i, p in enumerate(random_prompts(10, seed=3))]
    arm = chain_arm("ngram" if drafter == "ngram" else "small", 5)

    def prop():
        return NGramProposer() if drafter == "ngram" else SmallModelProposer(small)

    plain, _ = run(target, reqs, None, None, 16, None)
    eager, _ = run(target, reqs, arm, prop(), 16, None)
    graphed, eng = run(target, reqs, arm, prop(), 16, VerifyGraphs)
    assert graphed == eager == plain
    g = graphs_of(eng)
    assert len(g) >= 1 and g.capture_seconds > 0
    print(f"\ntiny fp32 {drafter}: {len(g)} verify graphs {g.keys()}, capture {g.capture_seconds:.2f} s, "
          f"pool {g.pool_bytes / 2**20:.1f} MiB")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_smollm2_verify_step_time_graphed_vs_eager() -> None:
    from worker.tlt.bench import chat_prompts, gsm8k_questions
    from worker.tlt.config import ModelSource
    from worker.tlt.model.load import load_model

    model, tok = load_model(ModelSource(builtin="smollm2-135m-instruct", dtype="bfloat16"), "cuda")
    prompts = chat_prompts(tok, gsm8k_questions("gsm8k", 16))
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=128)) for p in prompts]
    rows = []
    for graphs in (None, VerifyGraphs):
        eng = Engine(model, eos_ids=tok.eos_ids, config=EngineConfig(max_len=512, max_slots=16),
                     controller=AdaptiveSd.fixed(chain_arm("ngram", 6)), proposers={"ngram": NGramProposer()})
        if graphs is None:
            attach(eng, None)  # the engine builds its own on CUDA: the reference path stays eager
        else:
            g = VerifyGraphs(eng.graph_pool)
            attach(eng, g)
            g.warmup(eng.state, {b: [(7, 6, 1, False)] for b in (1, 2, 4, 8, 16)}, GREEDY)  # captures before timing
        eng.generate(reqs)  # warm-up (n-gram, allocator)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = eng.generate(reqs)
        wall = time.perf_counter() - t0
        spec = [s.seconds for s in out.steps if s.kind == "spec"]
        rows.append((graphs is not None, wall, sum(spec) / len(spec), [s.tokens for s in out.sequences], eng))
    (_, w0, t_eager, toks0, _), (_, w1, t_graph, toks1, eng) = rows
    same = sum(a == b for a, b in zip(toks0, toks1, strict=True)) / len(toks0)
    g = graphs_of(eng)
    print(f"\nSmolLM2 bf16 16 seqs, n-gram chain 6: spec step eager {t_eager * 1e3:.1f} ms, graphed "
          f"{t_graph * 1e3:.1f} ms ({t_eager / t_graph:.1f}x); generate {w0:.2f} s vs {w1:.2f} s; "
          f"{len(g)} graphs, capture {g.capture_seconds:.2f} s, pool {g.pool_bytes / 2**20:.0f} MiB; "
          f"identical sequences {same:.2f}")
    # no speed assertion: speed belongs in bench/ (the step times are printed above)
    assert same >= 0.8  # bf16: batch shapes round differently, a few late divergences are expected
