"""The speculative commit kernel (worker/tlt/kernels/spec_commit.py) against the body's torch path
(rollout/speculative_body.torch_commit) on the same inputs: the packed result and every row-state tensor equal, for chains
and trees, rows that hit an EOS inside the run, run out of max_new_tokens, were already done, or lie past the batch
(a graph's padding), several stop tokens per row, D from 1 to 7. CPU runs in Triton's interpreter
(tests/conftest.py); the `gpu` case compiled.
Run: python -m pytest tests/kernels/test_kernels_spec_commit.py -q   (GPU: add -m gpu)"""

from __future__ import annotations

import pytest
import torch

from worker.tlt.decoding.row_state import RowState
from worker.tlt.kernels.spec_commit import spec_commit
from worker.tlt.rollout.speculative_body import torch_commit


def _case(seed: int, r: int, depth: int, device: str) -> tuple[RowState, tuple]:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(seed)
    k = depth + 1
    st = RowState(r + 2, 64, 24, spare=k, device=torch.device("cpu"))  # drawn on the CPU, then moved
    st.done[:r] = torch.rand(r, generator=g) < 0.2
    st.n_gen[:r] = torch.randint(0, 20, (r,), generator=g)
    st.max_new[:r] = st.n_gen[:r] + torch.randint(1, 8, (r,), generator=g)  # some rows run out within the run
    st.lens[:r] = torch.randint(5, 40, (r,), generator=g)
    st.last[:r] = torch.randint(0, 30, (r,), generator=g)
    st.eos[:r, 0] = 3
    st.eos[: r // 2, 1] = 7  # two stop tokens on some rows
    tokens = torch.randint(0, 30, (r, k), generator=g)  # 30 ids: EOS 3 / 7 show up inside runs
    logprobs = -torch.rand(r, k, generator=g)
    emitted = torch.randint(1, k + 1, (r,), generator=g)
    counts = torch.maximum(emitted, torch.randint(1, k + 1, (r,), generator=g))
    row_depth = counts - 1 - torch.randint(0, 2, (r,), generator=g).clamp_max(counts - 1)  # a tree: <= counts - 1
    n_rows = torch.tensor([max(r - 2, 1)])  # the last rows are padding
    dev = torch.device(device)
    moved = RowState(st.slots, st.max_len, st.cap, st.spare, dev)
    moved.restore([t.to(dev) for t in st.snapshot()])
    st = moved
    args = tuple(t.to(dev) for t in (tokens, logprobs, emitted, counts, row_depth, n_rows))
    return st, args


@pytest.mark.parametrize("seed,rows,depth", [(0, 1, 1), (1, 4, 3), (2, 8, 6), (3, 13, 7), (4, 16, 4)])
@pytest.mark.parametrize("chain", [True, False])
def test_kernel_commits_and_counts_what_torch_does(seed: int, rows: int, depth: int, chain: bool) -> None:
    _check(seed, rows, depth, chain, "cpu")


def _check(seed: int, rows: int, depth: int, chain: bool, device: str) -> None:
    st, (tokens, logprobs, emitted, counts, row_depth, n_rows) = _case(seed, rows, depth, device)
    ref = RowState(st.slots, st.max_len, st.cap, st.spare, st.lens.device)
    ref.restore(st.snapshot())
    depth_arg = None if chain else row_depth
    packed, n = spec_commit(tokens, logprobs, emitted, counts, depth_arg, n_rows, st, depth)
    want, want_n = torch_commit(tokens, logprobs, emitted, counts, depth_arg, n_rows, ref, depth)
    assert torch.equal(packed, want) and torch.equal(n, want_n)
    for name, a, b in zip(("lens", "last", "n_gen", "done", "out_tok", "out_lp"),
                          (st.lens, st.last, st.n_gen, st.done, st.out_tok, st.out_lp),
                          (ref.lens, ref.last, ref.n_gen, ref.done, ref.out_tok, ref.out_lp), strict=True):
        assert torch.equal(a, b), name
    assert bool((n > 0).any()) and bool((n[int(n_rows):] == 0).all())  # something committed; padding nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_commits_what_torch_does_on_cuda() -> None:
    for seed, rows, depth in ((5, 8, 6), (6, 64, 4), (7, 1, 4)):
        for chain in (True, False):
            _check(seed, rows, depth, chain, "cuda")
