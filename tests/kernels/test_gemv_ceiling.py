"""bench/gemv_ceiling.py's parts that run on CPU (Triton's interpreter): its list of a step's weight matrices reads
exactly the bytes the roofline counts (less the norms and biases, which no GEMM reads as a matrix), and its read
kernel sums every element once whatever the launch shape. Run: python -m pytest tests/kernels/test_gemv_ceiling.py -q"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
import triton

from worker.tlt.model.args import shape
from worker.tlt.model.roofline import weight_bytes

BENCH = runpy.run_path(str(Path(__file__).resolve().parents[2] / "bench" / "gemv_ceiling.py"), run_name="gemv_ceiling")


@pytest.mark.parametrize("name", ["qwen2.5-7b", "llama3-8b", "qwen2.5-1.5b"])
def test_matrices_read_the_roofline_weight_bytes(name: str) -> None:
    a = shape(name, vocab_size=49152)
    mats = BENCH["matrices"](a)
    gemm_bytes = sum(2 * n * k * count for n, k, count in mats.values())
    hd = a.n_heads * a.hd + 2 * a.n_kv_heads * a.hd
    norms_biases = 2 * (a.n_layers * (2 * a.dim + (hd if a.qkv_bias else 0) + (2 * a.hd if a.qk_norm else 0)) + a.dim)
    assert gemm_bytes + norms_biases == weight_bytes(a)


@pytest.mark.parametrize("block,iters", [(1024, 8), (4096, 1), (2048, 2)])
def test_read_kernel_sums_every_element_once(block: int, iters: int) -> None:
    x = torch.randn(50_001, dtype=torch.bfloat16)
    out = torch.empty(triton.cdiv(x.numel(), block * iters), dtype=torch.float32)
    BENCH["_read_kernel"][(out.numel(),)](x, out, x.numel(), BLOCK=block, ITERS=iters)
    assert out.sum().item() == pytest.approx(x.float().sum().item(), abs=1e-2)
