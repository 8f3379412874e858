"""KV cache: budget sizing, row moves, and keeping only accepted tree nodes (roll-back).
Run: python -m pytest tests/engine/test_engine_kv_cache.py -q"""

from __future__ import annotations

import torch

from worker.tlt.decoding.kv_cache import KVCache, bytes_per_token, slots_for_budget
from worker.tlt.model.args import preset


def _cache() -> KVCache:
    args = preset("tiny-llama", n_layers=2)
    c = KVCache.allocate(args, slots=3, max_len=16, device="cpu", dtype=torch.float32)
    for i, t in enumerate((*c.k, *c.v)):
        # value encodes (tensor, row, column) so moves are visible
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + 1000 * i)
    return c


def test_budget_sizing() -> None:
    args = preset("smollm2-135m")
    per_tok = bytes_per_token(args, torch.bfloat16)
    assert per_tok == 2 * 30 * 3 * 64 * 2
    assert slots_for_budget(args, 1024, 1.0, torch.bfloat16) == 2**30 // (per_tok * 1024)
    assert slots_for_budget(args, 1024, 1e-9, torch.bfloat16) == 1


def test_move_rows() -> None:
    c = _cache()
    before = [t.clone() for t in c.k]
    c.move_rows(torch.tensor([2]), torch.tensor([0]))
    for b, t in zip(before, c.k, strict=True):
        assert torch.equal(t[0], b[2]) and torch.equal(t[1], b[1]) and torch.equal(t[2], b[2])


def test_compact_accepted_keeps_accepted_nodes_in_path_order() -> None:
    c = _cache()
    before = [t.clone() for t in (*c.k, *c.v)]
    base = torch.tensor([3, 5, 0])
    # row 0 accepted nodes 2 then 5; row 1 accepted nothing; row 2 accepted node 1 (identity) then 4
    src = torch.tensor([[2, 5, 0], [1, 2, 3], [1, 4, 0]])
    n_keep = torch.tensor([2, 0, 2])
    c.compact_accepted(base, src, n_keep)
    for b, t in zip(before, (*c.k, *c.v), strict=True):
        exp = b.clone()
        exp[0, :, 4], exp[0, :, 5] = b[0, :, 5], b[0, :, 8]
        exp[2, :, 2] = b[2, :, 4]
        assert torch.equal(t, exp)
