"""Fused Triton kernels for the engine's cached forward (batch-1 decode is launch-bound: five kernels per layer
instead of ~25). Importing `worker.tlt.kernels.forward` decorates the kernels, so on CPU set TRITON_INTERPRET=1
before that import (the tests do). This package file imports nothing so that `import worker.tlt.kernels` never
needs triton; `resolve_fused()` decides whether an engine turns the fused path on (EngineConfig.fused_kernels).
Tests: `python -m pytest tests/kernels -q`.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from worker.tlt.decoding.streams import DRAFT, row_exponentials
from worker.tlt.model.args import ModelArgs

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_available(device: torch.device) -> str | None:
    """Why the fused kernels cannot run on `device` (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "off CUDA the kernels need Triton's interpreter: set TRITON_INTERPRET=1 before importing them"
    return None


def stream_noise(keys: torch.Tensor, pos: torch.Tensor, purpose: int, vocab: int) -> torch.Tensor:
    """Exp(1) draws [B, V] of rows' streams (decoding/streams.row_exponentials): on CUDA one Triton kernel
    (keyed_noise.py; the torch version's ~19 int64 passes over [B, V] cost more than a small model's decode step),
    elsewhere torch. One producer per device, so every path of a device (eager, graphed, fused; the target's sampler,
    the verifier, the drafters) reads the same numbers."""
    if keys.is_cuda and fused_available(keys.device) is None:
        from worker.tlt.kernels.keyed_noise import stream_exponentials  # imports triton: only on CUDA

        return stream_exponentials(keys, pos, purpose, vocab)
    return row_exponentials(keys, pos, purpose, vocab)


def draft_noise(streams: tuple[torch.Tensor, torch.Tensor], depth: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, V] of a sampled draft at `depth` (0 = the first draft) for rows whose (keys, emitted counts)
    are `streams`: keyed on the emitted-token index the draft proposes (decoding/streams.DRAFT)."""
    keys, n_gen = streams
    return stream_noise(keys, n_gen + depth, DRAFT, vocab)


def unsupported_reason(args: ModelArgs, dtype: torch.dtype) -> str | None:
    """Why the fused kernels cannot run this model (None: they can)."""
    d = args.hd
    if d < 16 or d & (d - 1):
        return f"head_dim {d} is not a power of 2 >= 16 (tl.arange / tl.dot tiles)"
    if args.n_heads % args.n_kv_heads:
        return f"n_heads {args.n_heads} is not a multiple of n_kv_heads {args.n_kv_heads}"
    if dtype not in DTYPES:
        return f"dtype {dtype} (supported: fp32, bf16, fp16)"
    return None


def resolve_fused(requested: bool | None, args: ModelArgs, device: torch.device, dtype: torch.dtype) -> bool:
    """EngineConfig.fused_kernels -> on / off. None: on where it can run on CUDA (else torch, silently); True: on,
    or a ValueError saying why it cannot be (on CPU it means Triton's interpreter, for tests); False: off."""
    if requested is False:
        return False
    reason = fused_available(device) if requested or device.type == "cuda" else "not on CUDA"
    reason = reason or unsupported_reason(args, dtype)
    if reason is not None and requested:
        raise ValueError(f"fused_kernels=True but the fused kernels cannot run: {reason}")
    return reason is None
