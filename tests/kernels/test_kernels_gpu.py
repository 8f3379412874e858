"""GPU checks of the fused kernels (marked `gpu`, never run by CI; an H200):
    python -m pytest tests/kernels -m gpu -q -s
- SmolLM2-shaped random model in bf16: the fused cached forward is close to the torch forward (decode and tree
  verify), and every row's logits are bit-identical alone and inside a batch (decode and verify);
- a CUDA graph of the fused forward replays to exactly the eager result on new inputs;
- engine (tiny fp32 on CUDA, fused on): graphed greedy == eager greedy, and greedy chain SD == plain greedy;
- the parallel configs (common.default_config's split attention and 16-row qkv tiles, whatever the tuned file says):
  batch invariance and graph replay again under them; qkv tiles bit-identical to whole heads in fp32; split
  attention close to unsplit in bf16 at SmolLM2 shapes, and its arrival counters back to 0 after a graph replay.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.kernels.cases import Batch, clone_cache, decode_batch, random_cache, tree_batch
from worker.tlt.kernels import tuning
from worker.tlt.kernels.settings import KernelConfig, configure
from worker.tlt.model.args import preset
from worker.tlt.model.load import random_model
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import Arm, chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.small_model import SmallModelProposer

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


@pytest.fixture(params=["tuned", "defaults"])
def configs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """The GPU's tuned configs (what the engine runs), or the default rule alone (split attention, qkv tiles)."""
    if request.param == "defaults":
        previous = configure(KernelConfig(tune=False, cache_dir=tmp_path))
        monkeypatch.setattr(tuning, "SEEDS", {})
        tuning.forget()
        yield "defaults"
        configure(previous)
        tuning.forget()
    else:
        yield "tuned"


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
def test_batch_invariance_bf16(smol: Transformer, kind: str, configs: str) -> None:
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


def test_cuda_graph_replay_equals_eager(smol: Transformer, configs: str) -> None:
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


def _engine_tokens(model: Transformer, graphs: bool, arm: Arm | None = None) -> list[list[int]]:
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=24)) for p in random_prompts(6, seed=3)]
    cfg = EngineConfig(max_len=96, max_slots=4, cuda_graphs=graphs, fused_kernels=True)
    engine = Engine(model, eos_ids=(257,), config=cfg, controller=AdaptiveSd.fixed(arm) if arm else None,
                    proposers={"small": SmallModelProposer(perturbed_copy(model, 0.15))})
    assert engine.step.fused
    return [s.tokens for s in engine.generate(reqs).sequences]


def test_engine_fused_graphs_and_sd_fp32_tiny() -> None:
    model = tiny_target().to("cuda")
    model.init_rope("cuda")
    eager = _engine_tokens(model, graphs=False)
    assert _engine_tokens(model, graphs=True) == eager
    assert _engine_tokens(model, graphs=True, arm=chain_arm("small", 3)) == eager


def test_qkv_tiles_bit_identical_fp32() -> None:
    """16 / 32-row tiles of a head: the very bits of whole-head programs (SmolLM2 shapes, fp32, 5 tokens)."""
    from worker.tlt.kernels.common import Config
    from worker.tlt.kernels.qkv_rope import qkv_rope_cache

    g = torch.Generator(device="cpu").manual_seed(0)
    hq, hkv, d, h, m, t = 9, 3, 64, 576, 5, 64

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).cuda()

    x, ln_w, w, cos, sin = rand(m, h), rand(h), rand((hq + 2 * hkv) * d, h) * 0.05, rand(t, d), rand(t, d)
    pos = torch.tensor([3, 17, 40, 41, 63], device="cuda")
    results = []
    for block_n in (64, 16, 32):
        ck, cv = torch.zeros(2, m, hkv, t, d, device="cuda")
        q = qkv_rope_cache(x, ln_w, w, None, None, None, cos, sin, pos, pos, ck, cv, s=1, row0=0, n_heads=hq,
                           eps=1e-5, config=Config(block_n, 64, 4, 2))
        results.append((q, ck, cv))
    for tiled in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(tiled, results[0], strict=True))


def test_split_attention_close_to_unsplit_and_counters_reset_in_graph() -> None:
    """SmolLM2 attention (9 / 3 heads, D 64) in bf16 over ragged rows up to 1500 columns: splits of 64 / 256 columns
    are within bf16 rounding of the unsplit kernel; a CUDA graph of the split launch replays (new inputs) to the
    eager result, and leaves every arrival counter at 0."""
    from worker.tlt.kernels.attention import _COUNTERS, cache_attention
    from worker.tlt.kernels.common import Config

    g = torch.Generator(device="cpu").manual_seed(1)
    lens, t = [5, 300, 77, 511, 1500], 1536
    ck, cv = (torch.randn(len(lens), 3, t, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))

    def inputs(seed: int, ls: list[int]) -> Batch:
        bt = decode_batch(ls, t, seed, device="cuda")
        bt.ids = torch.randn(len(ls), 9 * 64, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
        return bt  # ids: the queries

    a = inputs(2, lens)
    unsplit = cache_attention(a.ids, ck, cv, a.mask, a.widx.reshape(-1), row0=0, config=Config(64, 64, 4, 2))
    for split in (64, 256):
        cfg = Config(64, 64, 4, 2, split=split)
        out = cache_attention(a.ids, ck, cv, a.mask, a.widx.reshape(-1), row0=0, config=cfg)
        err = (out.float() - unsplit.float()).abs().max().item()
        print(f"split {split}: max |split - unsplit| {err:.2e}")
        assert err < 2e-2
        assert torch.equal(out[0], unsplit[0])  # 6 columns: one chunk, the unsplit kernel's bits
    cfg = Config(64, 64, 4, 2, split=64)
    static = inputs(2, lens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and size the counters outside the capture
        cache_attention(static.ids, ck, cv, static.mask, static.widx.reshape(-1), row0=0, config=cfg)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cache_attention(static.ids, ck, cv, static.mask, static.widx.reshape(-1), row0=0, config=cfg)
    b = inputs(3, [1499, 64, 65, 0, 700])
    for x, y in [(static.ids, b.ids), (static.widx, b.widx), (static.mask, b.mask)]:
        x.copy_(y)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())
    want = cache_attention(b.ids, ck, cv, b.mask, b.widx.reshape(-1), row0=0, config=cfg)
    assert torch.equal(out, want)
