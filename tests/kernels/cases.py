"""Inputs shared by the fused-kernel tests: tiny models of each family and cached-forward inputs (ragged decode rows,
tree-shaped verify rows) with the engine's mask conventions."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from worker.tlt.model.args import ModelArgs, RopeScaling, shape
from worker.tlt.model.transformer import Transformer
from worker.tlt.rollout.kv_cache import KVCache
from worker.tlt.rollout.reference import tiny_target

# (preset, overrides): Llama GQA G=2, Llama G=1, Qwen2 (qkv bias), Qwen3 (q/k norm, head_dim 32)
ARCHS: dict[str, tuple[str, dict[str, int]]] = {
    "llama-g2": ("tiny-llama", {}),
    "llama-g1": ("tiny-llama", {"n_kv_heads": 4}),
    "qwen2": ("tiny-qwen2", {}),
    "qwen3": ("tiny-qwen3", {}),
}
T = 64  # cache columns


def real_heads(name: str, n_heads: int, n_kv_heads: int, **over: Any) -> ModelArgs:
    """SHAPES[name]'s family features with its head_dim (128) and a GQA group of n_heads / n_kv_heads, in two layers
    of width 256 and a 320-token vocabulary: real head shapes at a size the CPU (and Triton's interpreter) runs."""
    return replace(shape(name), vocab_size=320, dim=256, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                   head_dim=128, intermediate_size=384, max_seq_len=1024, eos_token_ids=(257,), **over)


# Qwen2.5-7B's groups of 7 with q/k/v biases; Llama-3-8B's groups of 4 with its RoPE scaling; Qwen3-8B's groups of 8
# with q/k norm
REAL_HEADS: dict[str, ModelArgs] = {
    "qwen2.5-7b-g7": real_heads("qwen2.5-7b", 7, 1),
    "llama3-8b-g4": real_heads("llama3-8b", 8, 2, rope_theta=500000.0,
                               rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64)),
    "qwen3-8b-g8": real_heads("qwen3-8b", 8, 1),
}


def model_of(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Transformer:
    arch, over = ARCHS[name]
    return tiny_target(arch, 1, **over).to(device=device, dtype=dtype).eval()


def random_cache(model: Transformer, slots: int, seed: int, t: int = T) -> KVCache:
    w = model.head_weight
    cache = KVCache.allocate(model.args, slots, t, w.device, w.dtype)
    g = torch.Generator(device="cpu").manual_seed(seed)
    for x in (*cache.k, *cache.v):
        x.copy_(torch.randn(x.shape, generator=g))
    return cache


def clone_cache(c: KVCache) -> KVCache:
    return KVCache([x.clone() for x in c.k], [x.clone() for x in c.v])


@dataclass
class Batch:
    ids: torch.Tensor  # [B, S]
    pos: torch.Tensor  # [B, S]
    widx: torch.Tensor  # [B, S]
    mask: torch.Tensor  # [B, S, Tk] bool


def decode_batch(lens: list[int], tk: int, seed: int, device: str = "cpu") -> Batch:
    """One token per row at column lens[b] (ragged), attending columns 0..lens[b]."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.tensor(lens)[:, None]
    ids = torch.randint(0, 300, pos.shape, generator=g)
    mask = torch.arange(tk)[None, None, :] <= pos[:, :, None]
    return Batch(ids.to(device), pos.to(device), pos.to(device), mask.to(device))


def tree_batch(lens: list[int], parents: list[int], tk: int, seed: int, device: str = "cpu") -> Batch:
    """Verify rows: node j (parents[j], topological order) written at column lens[b] + j, position lens[b] + depth,
    attending the row's prefix and its ancestors (itself included)."""
    g = torch.Generator().manual_seed(seed)
    w = len(parents)
    anc = torch.zeros(w, w, dtype=torch.bool)
    depth = [0] * w
    for j, p in enumerate(parents):
        anc[j, j] = True
        if p >= 0:
            anc[j] |= anc[p]
            depth[j] = depth[p] + 1
    base = torch.tensor(lens)[:, None]
    widx = base + torch.arange(w)[None, :]
    pos = base + torch.tensor(depth)[None, :]
    mask = (torch.arange(tk)[None, None, :] < base[:, :, None]).expand(len(lens), w, tk).clone()
    mask.scatter_(2, widx[:, None, :].expand(len(lens), w, w), anc.expand(len(lens), w, w).clone())
    ids = torch.randint(0, 300, pos.shape, generator=g)
    return Batch(ids.to(device), pos.to(device), widx.to(device), mask.to(device))
