"""GPU checks of the fused kernels (marked `gpu`, never run by CI; an H200):
    python -m pytest tests/kernels -m gpu -q -s
- SmolLM2-shaped random model in bf16: the fused cached forward is close to the torch forward (decode and tree
  verify), and every row's logits are bit-identical alone and inside a batch (decode and verify);
- a CUDA graph of the fused forward replays to exactly the eager result on new inputs;
- engine (tiny fp32 on CUDA, fused on): graphed greedy == eager greedy, and greedy chain SD == plain greedy;
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.cases import Batch, clone_cache, decode_batch, random_cache, tree_batch
from worker.tlt.model.args import preset
from worker.tlt.model.load import random_model
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, SamplingParams, SpecConfig
from worker.tlt.spec.small_model import SmallModelConfig, SmallModelProposer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="Triton's interpreter is on: run the GPU tests alone with -m gpu (conftest.py)"),
]
T = 640


@pytest.fixture(scope="module")
def smol() -> Transformer:
    model = random_model(preset("smollm2-135m"), seed=0, device="cuda", dtype=torch.bfloat16, std=0.05)
    model.init_rope("cuda", T)
    return model


def _fused():  # imported lazily: the module decorates the kernels (see conftest.py)
    from worker.tlt.kernels.forward import fused_forward_hidden

    return fused_forward_hidden


def _batch(kind: str, lens: list[int], seed: int) -> Batch:
    if kind == "decode":
        return decode_batch(lens, T, seed, device="cuda")
    return tree_batch(lens, [-1, 0, 0, 1, 2, 4, 1], T, seed, device="cuda")


@pytest.mark.parametrize("kind", ["decode", "tree"])
def test_fused_close_to_torch_bf16(smol: Transformer, kind: str) -> None:
    bt = _batch(kind, [5, 300, 77, 511], seed=1)
    ref_cache = random_cache(smol, slots=4, seed=2, t=T)
    cache = clone_cache(ref_cache)
    with torch.no_grad():
        ref = smol.forward_hidden(bt.ids, bt.pos, ref_cache, write_idx=bt.widx, attn_mask=bt.mask, layers=(2, 15))
    out = _fused()(smol, bt.ids, bt.pos, cache, write_idx=bt.widx, attn_mask=bt.mask, layers=(2, 15))
    for got, want in [(out[0], ref[0]), (out[1], ref[1]), (out[2][15], ref[2][15])]:
        err = (got.float() - want.float()).norm() / want.float().norm()
        print(f"{kind}: relative error {err:.2e}")
        assert err < 5e-2  # bf16 rounding differs in a few places per layer (SDPA, cuBLAS), over 30 layers
    for new, want in zip((*cache.k, *cache.v), (*ref_cache.k, *ref_cache.v), strict=True):
        assert ((new.float() - want.float()).abs().max()) < 0.1 * want.float().abs().max()


@pytest.mark.parametrize("kind", ["decode", "tree"])
def test_batch_invariance_bf16(smol: Transformer, kind: str) -> None:
    lens = [3, 200, 57, 410, 11]
    bt = _batch(kind, lens, seed=3)
    base = random_cache(smol, slots=5, seed=4, t=T)
    fused = _fused()
    full, _, _ = fused(smol, bt.ids, bt.pos, clone_cache(base), write_idx=bt.widx, attn_mask=bt.mask)
    for r in range(len(lens)):
        one = Batch(bt.ids[r:r + 1], bt.pos[r:r + 1], bt.widx[r:r + 1], bt.mask[r:r + 1])
        alone, _, _ = fused(smol, one.ids, one.pos, clone_cache(base), cache_rows=slice(r, r + 1),
                            write_idx=one.widx, attn_mask=one.mask)
        assert torch.equal(alone[0], full[r]), r


def test_cuda_graph_replay_equals_eager(smol: Transformer) -> None:
    fused = _fused()
    a, b = decode_batch([10, 40], T, seed=5, device="cuda"), decode_batch([250, 7], T, seed=6, device="cuda")
    cache = random_cache(smol, slots=2, seed=7, t=T)
    static = Batch(a.ids.clone(), a.pos.clone(), a.widx.clone(), a.mask.clone())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: JIT compile outside the capture
        fused(smol, static.ids, static.pos, cache, write_idx=static.widx, attn_mask=static.mask)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, _ = fused(smol, static.ids, static.pos, cache, write_idx=static.widx, attn_mask=static.mask)
    eager_cache = clone_cache(cache)
    for x, y in [(static.ids, b.ids), (static.pos, b.pos), (static.widx, b.widx), (static.mask, b.mask)]:
        x.copy_(y)
    graph.replay()
    want, _, _ = fused(smol, b.ids, b.pos, eager_cache, write_idx=b.widx, attn_mask=b.mask)
    assert torch.equal(out, want)
    assert all(torch.equal(x, y) for x, y in zip((*cache.k, *cache.v), (*eager_cache.k, *eager_cache.v), strict=True))


def _engine_tokens(model: Transformer, graphs: bool, spec: SpecConfig | None = None) -> list[list[int]]:
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=24)) for p in random_prompts(6, seed=3)]
    proposer = None if spec is None else SmallModelProposer(perturbed_copy(model, 0.15), SmallModelConfig(topk=1))
    cfg = EngineConfig(max_len=96, max_slots=4, cuda_graphs=graphs, fused_kernels=True)
    engine = Engine(model, eos_ids=(257,), config=cfg, spec=spec, proposer=proposer)
    assert engine.step.fused
    return [s.tokens for s in engine.generate(reqs).sequences]


def test_engine_fused_graphs_and_sd_fp32_tiny() -> None:
    model = tiny_target().to("cuda")
    model.init_rope("cuda")
    eager = _engine_tokens(model, graphs=False)
    assert _engine_tokens(model, graphs=True) == eager
    assert _engine_tokens(model, graphs=True, spec=SpecConfig("on", "chain", depth=3)) == eager
