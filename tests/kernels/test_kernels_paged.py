"""The fused kernels through block tables (Triton's interpreter on CPU, tiny fp32 models): the engine on the paged
layout with `fused_kernels=True` (qkv_rope writing K/V into pages, split attention reading them; or the GEMM path's
rope_cache) decodes greedily the same tokens as the torch forward on the row layout, with sequences preempted and
swapped back, and a chain speculative step verifies through the table as well.
Run: python -m pytest tests/kernels/test_kernels_paged.py -q"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worker.tlt.kernels import forward as fused_forward
from worker.tlt.kernels.common import Config
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import perturbed_copy, random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling
from worker.tlt.speculative.arm import chain_arm
from worker.tlt.speculative.control.controller import AdaptiveSd
from worker.tlt.speculative.proposers.small_model import SmallModelProposer


def _requests() -> list[Request]:
    return [Request(p, RequestSampling(temperature=0.0, max_new_tokens=14 + 2 * i, n=2))
            for i, p in enumerate(random_prompts(3, seed=7, hi=14))]


def _tokens(model: torch.nn.Module, reqs: list[Request], **cfg: Any) -> tuple[list[list[int]], Engine]:
    extra: dict[str, Any] = cfg.pop("sd", {})
    engine = Engine(model, eos_ids=(257,), config=EngineConfig(max_len=64, sync_every=3, **cfg), **extra)
    return [s.tokens for s in engine.generate(reqs).sequences], engine


@pytest.mark.parametrize("gemm", [False, True])
def test_fused_paged_with_preemption_equals_torch_rows(gemm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_target()
    reqs = _requests()
    want, _ = _tokens(model, reqs, max_slots=6, fused_kernels=False)
    if gemm:  # the large-layer path: cuBLAS-style GEMMs with rope_cache writing the pages
        monkeypatch.setattr(fused_forward, "prefers_gemm", lambda args, dtype_bytes: True)
    got, eng = _tokens(model, reqs, max_slots=6, fused_kernels=True, page_size=8, kv_pages=12)
    assert eng.step.fused and eng.preemptions > 0
    assert got == want


def test_fused_paged_chain_speculation_equals_plain() -> None:
    model = tiny_target()
    reqs = _requests()[:2]
    want, _ = _tokens(model, reqs, max_slots=4, fused_kernels=False)
    sd = {"controller": AdaptiveSd.fixed(chain_arm("small", 3)),
          "proposers": {"small": SmallModelProposer(perturbed_copy(model, noise=0.15))}}
    got, eng = _tokens(model, reqs, max_slots=4, fused_kernels=True, page_size=8, kv_pages=10, sd=sd)
    assert eng.preemptions > 0
    assert got == want


def test_split_attention_over_scattered_pages_equals_contiguous_rows() -> None:
    from worker.tlt.kernels.attention import cache_attention

    torch.manual_seed(0)
    slots, hkv, t, d, page, g = 2, 2, 64, 16, 8, 2
    rows_k, rows_v = torch.randn(slots, hkv, t, d), torch.randn(slots, hkv, t, d)
    perm = torch.randperm(slots * t // page) + 1  # page 0 is scratch
    table = perm.view(slots, t // page).to(torch.int32)
    pk, pv = torch.randn(1 + slots * t // page, hkv, page, d), torch.randn(1 + slots * t // page, hkv, page, d)
    for r in range(slots):
        for j in range(t // page):
            pk[table[r, j]], pv[table[r, j]] = rows_k[r, :, j * page:(j + 1) * page], rows_v[r, :, j * page:(j + 1) * page]
    q = torch.randn(slots, g * hkv * d)
    widx = torch.tensor([37, 50])
    mask = torch.arange(t)[None, None, :] <= widx[:, None, None]
    for cfg in (Config(16, 0, 4, 2, split=0), Config(16, 0, 4, 2, split=16)):
        want = cache_attention(q, rows_k, rows_v, mask, widx, row0=0, config=cfg)
        got = cache_attention(q, pk, pv, mask, widx, row0=0, config=cfg, table=table)
        assert torch.equal(got, want)
