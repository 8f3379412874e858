"""HF parameter names <-> ours: our layers hold fused projections, HF checkpoints hold them separately.

    self_attn.{q,k,v}_proj.{weight,bias}  <->  self_attn.qkv_proj.{weight,bias}   (rows q | k | v)
    mlp.{gate,up}_proj.weight             <->  mlp.gate_up_proj.weight            (rows gate | up)

One larger GEMM instead of three (two) per layer: batch-1 decode is bound by kernel launches and latency, not by
FLOPs (gpt-fast's `wqkv` / `w1w3`, vLLM's `qkv_proj` / `gate_up_proj`). HF names stay the external format: the
loaders and `Transformer.load_state_dict` take HF names (`to_fused`), the exports write them (`to_hf`).
Works for any prefix (`model.layers.3.`, the drafter's `midlayer.` or none). Run:
`python -m pytest tests/engine/test_hf_names.py -q`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from worker.tlt.model.args import ModelArgs

# fused name -> its HF parts, in row order
FUSED: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PART_OF = {part: fused for fused, parts in FUSED.items() for part in parts}
_NAME = re.compile(r"^(?P<pre>(?:.*\.)?)(?P<mod>\w+)\.(?P<kind>weight|bias)$")


def to_fused(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named state dict -> ours (new dict, key order kept; fused tensors are concatenated copies). Names that
    are already ours pass through, so applying it twice is harmless."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        m = _NAME.match(name)
        fused = _PART_OF.get(m["mod"]) if m else None
        if m is None or fused is None:
            out[name] = t
            continue
        names = [f"{m['pre']}{p}.{m['kind']}" for p in FUSED[fused]]
        missing = [n for n in names if n not in sd]
        if missing:
            raise KeyError(f"cannot fuse {name}: {missing} missing")
        if name == names[0]:  # written once, where the first part was
            out[f"{m['pre']}{fused}.{m['kind']}"] = torch.cat([sd[n] for n in names], dim=0)
    return out


def split_sizes(fused: str, args: ModelArgs) -> tuple[int, ...]:
    """Rows of each HF part of a fused projection."""
    if fused == "qkv_proj":
        return (args.n_heads * args.hd, args.n_kv_heads * args.hd, args.n_kv_heads * args.hd)
    return (args.intermediate_size, args.intermediate_size)


def to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names (new dict, key order kept). The split parts are copies, not views of one storage
    (safetensors refuses tensors that share memory)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        m = _NAME.match(name)
        if m is None or m["mod"] not in FUSED:
            out[name] = t
            continue
        sizes = split_sizes(m["mod"], args)
        if sum(sizes) != t.shape[0]:
            raise ValueError(f"{name} has {t.shape[0]} rows, not {sum(sizes)} ({sizes})")
        for part, piece in zip(FUSED[m["mod"]], t.split(sizes, dim=0), strict=True):
            out[f"{m['pre']}{part}.{m['kind']}"] = piece.clone()
    return out


def _fuse_hf_names_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    # load_state_dict hands its hooks its own copy of the dict: rewriting it in place leaves the caller's alone.
    fused = to_fused(state_dict)
    if len(fused) != len(state_dict):
        state_dict.clear()
        state_dict.update(fused)


def accept_hf_names(module: nn.Module) -> None:
    """Let `module.load_state_dict` take HF-named (unfused) state dicts as well as ours."""
    module.register_load_state_dict_pre_hook(_fuse_hf_names_hook)
