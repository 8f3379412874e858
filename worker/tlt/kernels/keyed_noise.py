"""decoding/streams.exponentials in one Triton kernel: the Exp(1) noise [B, V] of each row's random stream.

The torch version runs ~19 elementwise kernels over int64 [B, V] tensors (the splitmix64 finaliser, the float
conversion, the log): at batch 64 over a 152k vocabulary that is ~3 GB of memory traffic per decode step. Here one
program per (row, block of columns) computes the same uint64 hash in registers and writes only the float32 result:
the integer bits are the torch version's exactly, the float result up to the device's float32 log (the engine uses
one producer per device, so eager, graphed and fused paths read the same numbers).
Tests: `python -m pytest tests/kernels/test_kernels_keyed_noise.py -q` (CPU interpreter).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from worker.tlt.decoding import streams
from worker.tlt.decoding.streams import _M1, _M2, GOLDEN, draw_keys

log = logging.getLogger(__name__)

BLOCK = 1024


@triton.jit
def _keyed_exp_kernel(rk_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rk = tl.load(rk_ptr + b).to(tl.uint64, bitcast=True)
    i = (cols + 1).to(tl.uint64)
    x = rk + i * tl.full((), GOLDEN, tl.uint64)
    x = (x ^ (x >> 30)) * tl.full((), _M1, tl.uint64)
    x = (x ^ (x >> 27)) * tl.full((), _M2, tl.uint64)
    x = x ^ (x >> 31)
    bits = (x >> 40).to(tl.float32)
    e = -tl.log((bits + 0.5) * (1.0 / 16777216.0))
    tl.store(out_ptr + b * stride + cols, e, mask=cols < V)


def keyed_exponentials(rk: torch.Tensor, n: int) -> torch.Tensor:  # [B] int64 draw keys -> [B, n] float32 Exp(1)
    """streams.exponentials(rk, n) in one kernel (module docstring)."""
    b = rk.shape[0]
    out = torch.empty(b, n, dtype=torch.float32, device=rk.device)
    if b and n:
        _keyed_exp_kernel[(b, triton.cdiv(n, BLOCK))](rk.contiguous(), out, n, out.stride(0), BLOCK=BLOCK)
    return out


def row_exponentials(keys: torch.Tensor, pos: torch.Tensor, purpose: int, n: int) -> torch.Tensor:
    """streams.row_exponentials in the kernel: [B] keys, [B] emitted-token indices -> [B, n]."""
    return keyed_exponentials(draw_keys(keys, pos, purpose), n)


@functools.cache
def agrees_on(device: torch.device) -> bool:
    """Whether the compiled kernel gives the torch hash's numbers on `device`, checked once per device (keys with
    the sign bit set, zero, the extremes; a ragged last block). The samplers use the kernel only where it does, so a
    compiler that mistranslates the uint64 arithmetic costs speed (the torch hash), never exactness; it is logged."""
    keys = torch.tensor([streams.sequence_key(3, i) for i in range(5)] + [-(2**63), 0, 2**63 - 1], device=device)
    pos = torch.arange(8, device=device) * 7
    try:
        got = row_exponentials(keys, pos, streams.SAMPLE, 3000)
    except Exception as e:  # a compile or launch failure of this Triton on this device
        log.warning("keyed-noise kernel failed on %s (%s): sampling uses the torch hash", device, e)
        return False
    ok = torch.allclose(got, streams.row_exponentials(keys, pos, streams.SAMPLE, 3000), rtol=2e-6, atol=0.0)
    if not ok:
        log.warning("keyed-noise kernel differs from the torch hash on %s: sampling uses the torch hash", device)
    return ok


def stream_exponentials(keys: torch.Tensor, pos: torch.Tensor, purpose: int, n: int) -> torch.Tensor:
    """Rows' stream noise [B, n] from the kernel where it agrees with the torch hash on this device, else from the
    torch hash: one producer per device either way, so every path of a device reads the same numbers."""
    if agrees_on(keys.device):
        return row_exponentials(keys, pos, purpose, n)
    return streams.row_exponentials(keys, pos, purpose, n)
