"""The graph-captured verify forward (rollout/verify_graphs.py): static buffers, padded nodes, free pad rows.

- CPU: the graph path with an eager "replay" (same buffers, same padding, same K/V writes; only the capture is
  missing) gives greedy SD output token-identical to plain greedy decoding, with batch buckets wider than the active
  batch (free pad rows) and arm widths wider than the drafts (padded nodes), n-gram chains and small-model trees;
- GPU (`-m gpu`): real CUDA graphs, tiny fp32 model: graphed verify == eager verify == plain greedy, token for
  token; SmolLM2 bf16: per-step time graphed vs eager and capture seconds / pool memory are printed.

Run: `python -m pytest tests/spec/test_spec_verify_graphs.py -q` (CPU) and, on a GPU machine,
`python -m pytest tests/spec/test_spec_verify_graphs.py -q -m gpu -s`.
"""

from __future__ import annotations

import time

import pytest
import torch

from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, SamplingParams, SpecConfig
from worker.tlt.rollout.verify_graphs import VerifyGraphs, _Entry
from worker.tlt.spec.ngram import NGramConfig, NGramProposer
from worker.tlt.spec.small_model import SmallModelConfig, SmallModelProposer

TARGET = tiny_target()
DRAFTER = perturbed_copy(TARGET, noise=0.15)


class _EagerReplay:
    def __init__(self, graphs: VerifyGraphs, e: _Entry) -> None:
        self.graphs, self.e = graphs, e

    def replay(self) -> None:
        self.e.logits, self.e.hidden = self.graphs._forward(self.e)


class EagerVerifyGraphs(VerifyGraphs):
    """The graph path without CUDA: every "replay" runs the forward on the static buffers."""

    def _capture(self, e: _Entry, key: tuple[int, int, int]) -> _Entry:
        e.graph = _EagerReplay(self, e)  # type: ignore[assignment]
        return e


def attach(eng: Engine, graphs: VerifyGraphs | None) -> None:
    """What Engine.__init__ does on CUDA (`engine.verify_graphs`, read by rollout/speculative.py with getattr)."""
    eng.__dict__["verify_graphs"] = graphs


def graphs_of(eng: Engine) -> VerifyGraphs:
    return eng.__dict__["verify_graphs"]


def run(model, reqs: list[Request], spec: SpecConfig | None, proposer, slots: int, graphs: type | None,
        device: str = "cpu") -> tuple[list[list[int]], Engine]:
    eng = Engine(model, eos_ids=(257,), config=EngineConfig(max_len=96, max_slots=slots, sync_every=4),
                 spec=spec, proposer=proposer)
    if graphs is not None:
        attach(eng, graphs(eng.model, eng.cache))
    else:
        eng.verify_graphs = None  # on CUDA the engine builds its own: the reference path stays eager
    return [s.tokens for s in eng.generate(reqs).sequences], eng


CASES = [  # (sequences, slots, spec, drafter)
    (5, 16, SpecConfig("on", "chain", depth=6), "ngram"),  # bucket 8 > 5 active: free pad rows; short n-gram drafts
    (12, 12, SpecConfig("on", "chain", depth=4), "small"),  # continuous batching shrinks the batch inside a bucket
    (6, 8, SpecConfig("on", "tree", depth=3, topk=2, verify_tokens=7), "small"),
]


@pytest.mark.parametrize(("n", "slots", "spec", "drafter"), CASES, ids=[f"{c[3]}-{c[2].method}" for c in CASES])
def test_graph_path_on_cpu_equals_plain_greedy(n: int, slots: int, spec: SpecConfig, drafter: str) -> None:
    reqs = [Request(p * 2, SamplingParams(temperature=0.0, max_new_tokens=20 + 3 * i))
            for i, p in enumerate(random_prompts(n, seed=n))]
    topk = spec.topk if spec.method == "tree" else 1
    prop = NGramProposer(NGramConfig(topk=topk)) if drafter == "ngram" else SmallModelProposer(
        DRAFTER, SmallModelConfig(topk=topk))
    plain, _ = run(TARGET, reqs, None, None, slots, None)
    graphed, eng = run(TARGET, reqs, spec, prop, slots, EagerVerifyGraphs)
    assert graphed == plain
    g = graphs_of(eng)
    assert len(g) >= 1 and all(w == spec.num_nodes for _, w, _ in g.keys())  # one width per arm shape
    assert {tk for _, _, tk in g.keys()} == {eng.cache.max_len}  # whole-cache attention by default
    assert any(b > 1 for b, _, _ in g.keys())
    assert eng.accept_stats.steps > 0


def test_warmup_captures_every_shape_and_bucketed_attention_stays_exact() -> None:
    """warmup() captures each (batch bucket, width[, attention bucket]) ahead of time; the rollout then captures
    nothing new, and attention over length buckets (attn_bucket) gives the same tokens as plain decoding."""
    reqs = [Request(p * 2, SamplingParams(temperature=0.0, max_new_tokens=30 + 2 * i))
            for i, p in enumerate(random_prompts(6, seed=11))]
    plain, _ = run(TARGET, reqs, None, None, 8, None)
    eng = Engine(TARGET, eos_ids=(257,), config=EngineConfig(max_len=96, max_slots=8, sync_every=4),
                 spec=SpecConfig("on", "chain", depth=4), proposer=NGramProposer())
    graphs = EagerVerifyGraphs(eng.model, eng.cache, attn_bucket=32)
    attach(eng, graphs)
    graphs.warmup(eng, max_batch=8, widths=(5,))
    captured = graphs.keys()
    assert {(b, w) for b, w, _ in captured} == {(1, 5), (2, 5), (4, 5), (8, 5)}
    assert len({tk for _, _, tk in captured}) > 1  # attention length buckets
    assert [s.tokens for s in eng.generate(reqs).sequences] == plain
    assert graphs.keys() == captured  # nothing captured during the rollout


# ---- GPU ------------------------------------------------------------------------------------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("drafter", ["ngram", "small"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_verify_equals_eager(drafter: str) -> None:
    target = tiny_target().to("cuda").float()
    small = perturbed_copy(target, noise=0.15)
    reqs = [Request(p * 2, SamplingParams(temperature=0.0, max_new_tokens=20 + 3 * i))  # prompt + new <= max_len 96
            for i, p in enumerate(random_prompts(10, seed=3))]
    spec = SpecConfig("on", "chain", depth=5)

    def prop():
        return NGramProposer() if drafter == "ngram" else SmallModelProposer(small, SmallModelConfig(topk=1))

    plain, _ = run(target, reqs, None, None, 16, None)
    eager, _ = run(target, reqs, spec, prop(), 16, None)
    graphed, eng = run(target, reqs, spec, prop(), 16, VerifyGraphs)
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
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=128)) for p in prompts]
    rows = []
    for graphs in (None, VerifyGraphs):
        eng = Engine(model, eos_ids=tok.eos_ids, config=EngineConfig(max_len=512, max_slots=16),
                     spec=SpecConfig("on", "chain", depth=6), proposer=NGramProposer())
        if graphs is None:
            eng.verify_graphs = None  # the engine builds its own on CUDA: the reference path stays eager
        else:
            g = VerifyGraphs.for_engine(eng)
            assert g is not None
            attach(eng, g)
            g.warmup(eng, max_batch=16, widths=(7,))  # captures before timing
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
