"""`DraftKV`: the K/V of an EAGLE drafter's entries, shared by the drafter (speculative/drafter/model.py), its fused step
(speculative/drafter/fused_step.py) and the proposers that draft with it.

Run the tests: `python -m pytest tests/drafter/test_drafter_model.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.tlt.model.args import ModelArgs


@dataclass
class DraftKV:
    """K/V of drafter entries, each [B, Hkv, T, D]. Either grown by concatenation (`extend`: training, trees) or a
    buffer allocated once and written by column (`step(..., write_at=...)`: the graph-captured chain draft)."""

    k: torch.Tensor
    v: torch.Tensor

    @staticmethod
    def allocate(batch: int, args: ModelArgs, length: int, like: torch.Tensor) -> DraftKV:
        shape = (batch, args.n_kv_heads, length, args.hd)
        return DraftKV(like.new_zeros(shape), like.new_zeros(shape))

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> DraftKV:  # [B, Hkv, S, D] each
        return DraftKV(torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2))

    @property
    def length(self) -> int:
        return int(self.k.shape[2])
