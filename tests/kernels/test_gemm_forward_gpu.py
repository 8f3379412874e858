"""GPU checks of the large-model cached forward (kernels/gemm_forward.py; marked `gpu`, never run by CI; an H200):
    python -m pytest tests/kernels/test_gemm_forward_gpu.py -m gpu -q
- the glue kernels round as torch's ops in bf16, bit for bit (Triton's CPU interpreter rounds bf16 otherwise);
- at Qwen2.5-7B's head shapes in bf16: close to the torch forward; with KernelConfig.gemm_pad_rows every row's logits
  are bit-identical alone and inside a batch, and a chain verify's root equals a 1-token decode;
- the engine with every model routed here (bf16, pad rows on): greedy chain SD == plain greedy, graphs on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.cases import Batch, clone_cache, decode_batch, random_cache, tree_batch
from worker.tlt.kernels.settings import KernelConfig, configure
from worker.tlt.model.args import shape
from worker.tlt.model.load import random_model
from worker.tlt.model.transformer import RMSNorm, Transformer, apply_rope
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.small_model import SmallModelProposer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="Triton's interpreter is on: run the GPU tests alone with -m gpu (conftest.py)"),
]
T = 512
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def qwen7b_heads() -> Transformer:
    """Qwen2.5-7B's heads (28 q, 4 kv of 128, biases) in 4 layers of width 3584 (MLP 4,096) and a 4,096-token vocabulary."""
    args = replace(shape("qwen2.5-7b"), n_layers=4, intermediate_size=4096, vocab_size=4096, max_seq_len=T, eos_token_ids=(257,))
    model = random_model(args, seed=0, device="cuda", dtype=BF16, std=0.02)
    model.init_rope("cuda", T)
    return model


@pytest.fixture()
def padded() -> Iterator[None]:
    previous = configure(KernelConfig(gemm_pad_rows=64))
    yield
    configure(previous)


def _gemm():  # imported lazily: the module decorates the kernels (see conftest.py)
    from worker.tlt.kernels.gemm_forward import gemm_forward_hidden

    return gemm_forward_hidden


def test_glue_kernels_round_as_torch_in_bf16() -> None:
    from worker.tlt.kernels.glue import add_rms_norm, rope_cache, silu_mul

    g = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(5, 3584, generator=g, device="cuda").to(BF16) for _ in range(2))
    norm = RMSNorm(3584, 1e-6).to("cuda", BF16)
    norm.weight.data = torch.randn(3584, generator=g, device="cuda").to(BF16)
    s, y = add_rms_norm(x, r, norm.weight, 1e-6)
    with torch.no_grad():
        assert torch.equal(s, x + r) and torch.equal(y, norm(x + r))
        assert torch.equal(add_rms_norm(x, None, norm.weight, 1e-6)[1], norm(x))
    gu = torch.randn(5, 2 * 18944, generator=g, device="cuda").to(BF16)
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(silu_mul(gu), F.silu(gate) * up)
    nq, nkv, d = 28, 4, 128
    qkv = torch.randn(2, (nq + 2 * nkv) * d, generator=g, device="cuda").to(BF16)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    f = torch.outer(torch.arange(T, device="cuda").float(), inv)
    cos, sin = torch.cat((f.cos(), f.cos()), -1), torch.cat((-f.sin(), f.sin()), -1)
    pos = torch.tensor([3, 300], device="cuda")
    ck, cv = (torch.zeros(2, nkv, T, d, dtype=BF16, device="cuda") for _ in range(2))
    q = rope_cache(qkv, None, None, cos, sin, pos, pos, ck, cv, s=1, row0=0, n_heads=nq, eps=1e-6)
    heads = qkv.view(2, 1, nq + 2 * nkv, d)
    want = apply_rope(heads[:, :, : nq + nkv], cos[pos][:, None, None].to(BF16), sin[pos][:, None, None].to(BF16))
    assert torch.equal(q, want[:, 0, :nq].reshape(2, nq * d))
    for b in range(2):
        assert torch.equal(ck[b, :, int(pos[b])], want[b, 0, nq:])
        assert torch.equal(cv[b, :, int(pos[b])], heads[b, 0, nq + nkv:])


def test_close_to_torch_bf16(qwen7b_heads: Transformer) -> None:
    bt = tree_batch([5, 300, 77], [-1, 0, 1, 2, 3, 4, 5, 6], T, seed=1, device="cuda")
    ref_cache = random_cache(qwen7b_heads, slots=3, seed=2, t=T)
    cache = clone_cache(ref_cache)
    with torch.no_grad():
        ref = qwen7b_heads.forward_hidden(bt.ids, bt.pos, ref_cache, write_idx=bt.widx, attn_mask=bt.mask)
    out = _gemm()(qwen7b_heads, bt.ids, bt.pos, cache, write_idx=bt.widx, attn_mask=bt.mask)
    err = (out[0].float() - ref[0].float()).norm() / ref[0].float().norm()
    assert err < 2e-2, err  # attention's bf16 rounding differs from SDPA's


@pytest.mark.parametrize("kind", ["decode", "tree"])
def test_pad_rows_make_rows_batch_invariant(qwen7b_heads: Transformer, padded: None, kind: str) -> None:
    lens = [3, 200, 57, 410, 11]
    bt = (decode_batch(lens, T, 3, device="cuda") if kind == "decode"
          else tree_batch(lens, [-1, 0, 1, 2, 3, 4, 5, 6], T, 3, device="cuda"))
    base = random_cache(qwen7b_heads, slots=5, seed=4, t=T)
    full, _, _ = _gemm()(qwen7b_heads, bt.ids, bt.pos, clone_cache(base), write_idx=bt.widx, attn_mask=bt.mask)
    for r in range(len(lens)):
        one = Batch(bt.ids[r:r + 1], bt.pos[r:r + 1], bt.widx[r:r + 1], bt.mask[r:r + 1])
        alone, _, _ = _gemm()(qwen7b_heads, one.ids, one.pos, clone_cache(base), cache_rows=slice(r, r + 1),
                              write_idx=one.widx, attn_mask=one.mask)
        assert torch.equal(alone[0], full[r]), r
        if kind == "tree":  # the chain's root decoded alone
            root = slice(0, 1)
            dec, _, _ = _gemm()(qwen7b_heads, one.ids[:, root], one.pos[:, root], clone_cache(base),
                                cache_rows=slice(r, r + 1), write_idx=one.widx[:, root],
                                attn_mask=one.mask[:, root].contiguous())
            assert torch.equal(dec[0, 0], full[r, 0]), r


def test_engine_greedy_sd_equals_plain_bf16(qwen7b_heads: Transformer, padded: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.tlt.kernels import gemm_forward

    monkeypatch.setattr(gemm_forward, "GEMM_LAYER_BYTES", 0)  # this 4-layer model takes the large-model forward too
    reqs = [Request(p, RequestSampling(temperature=0.0, max_new_tokens=32)) for p in random_prompts(6, seed=3)]

    def tokens(sd: bool) -> list[list[int]]:
        cfg = EngineConfig(max_len=128, max_slots=4, cuda_graphs=True, fused_kernels=True)
        engine = Engine(qwen7b_heads, eos_ids=(257,), config=cfg,
                        controller=AdaptiveSd.fixed(chain_arm("small", 4)) if sd else None,
                        proposers={"small": SmallModelProposer(perturbed_copy(qwen7b_heads, 0.05))})
        return [s.tokens for s in engine.generate(reqs).sequences]

    assert tokens(sd=True) == tokens(sd=False)
