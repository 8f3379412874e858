"""The fused sampler + commit (worker/tlt/kernels/sample_commit.py) against the decode step's torch path
(rollout/decode_step.py: process + choose_sampled / choose_greedy, then RowState.commit_no_sync) with the same logits
and noise: every row-state tensor equal (log-probs to 1e-5) for greedy, top-k off, top-k in {1, 5, 50, V - 1} over
several chunks with a ragged last one, bf16, fp16 and fp32 logits; ties (an all-equal row keeps all V; ties at the
k-th value spread over chunks, one chunk holding more than it stores, so it is rescanned); a temperature that rounds
different raw logits to the k-th s (the top-k select runs on raw logits: a chunk whose raw values are all below the
k-th raw value must still be rescanned); the raw logits' sort keys (16-bit for bf16 / fp16, 32-bit for fp32); the
commit's EOS / budget / done rules with rows past the batch untouched; which top-k it takes; and DecodeStep routing
GREEDY and uniform top-k batches through it with the tokens and row state of the torch path. CPU cases run in
Triton's interpreter (tests/conftest.py); the `gpu` case runs compiled at SmolLM2's vocabulary, eager and replayed
from a CUDA graph.
Run: python -m pytest tests/kernels/test_kernels_sample_commit.py -q   (GPU: add -m gpu)"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from worker.tlt.decoding.row_state import RowState
from worker.tlt.kernels import sample_commit as sc
from worker.tlt.kernels.sample_commit import sample_commit, supported
from worker.tlt.kernels.settings import KernelConfig, configure
from worker.tlt.rollout.decode_step import (
    GREEDY,
    MIXED,
    DecodeStep,
    Mode,
    choose_greedy,
    choose_sampled,
    process,
    sampling_mode,
)
from worker.tlt.rollout.engine import Engine
from worker.tlt.rollout.reference import random_prompts, tiny_target
from worker.tlt.rollout.types import EngineConfig, Request, RequestSampling


def _rows(slots: int, seed: int, device: str = "cpu") -> RowState:
    """Active rows with some history: n_gen, lens and last tokens set, budgets far away, no EOS."""
    g = torch.Generator().manual_seed(seed)
    rows = RowState(slots, 64, 16, 4, torch.device(device))
    n_gen = torch.randint(0, 8, (slots,), generator=g)
    rows.n_gen.copy_(n_gen)
    rows.lens.copy_(n_gen + 10)
    rows.last.copy_(torch.randint(0, 100, (slots,), generator=g))
    rows.max_new.fill_(16)
    rows.done.fill_(False)
    return rows


def _torch_step(logits: torch.Tensor, noise: torch.Tensor | None, rows: RowState, temp: float,
                top_k: int) -> torch.Tensor:
    """The decode step's torch path for one uniform setting (or greedy) -> n [B]."""
    b = logits.shape[0]
    if temp <= 0.0:
        tok, lp = choose_greedy(logits)
    else:
        assert noise is not None
        mode = Mode("uniform", temp, 1.0, top_k)
        probs, lsm = process(logits, mode, rows.temp[:b], rows.top_p[:b], rows.top_k[:b])
        tok, lp = choose_sampled(probs, noise, lsm, rows.temp[:b])
    return rows.commit_no_sync(slice(0, b), tok[:, None], lp[:, None], torch.ones_like(tok))


def _assert_same_rows(got: RowState, want: RowState) -> None:
    for name in ("lens", "last", "n_gen", "done", "max_new", "eos", "out_tok"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.out_lp, want.out_lp, atol=1e-5, rtol=0.0)


def _compare(logits: torch.Tensor, noise: torch.Tensor | None, temp: float, top_k: int, chunk_v: int | None,
             rows: RowState) -> torch.Tensor:
    """sample_commit and the torch path from copies of `rows`: same n and row state -> the tokens written."""
    b = logits.shape[0]
    want, got = RowState(rows.slots, 64, 16, 4, logits.device), RowState(rows.slots, 64, 16, 4, logits.device)
    want.restore(rows.snapshot())
    got.restore(rows.snapshot())
    n_want = _torch_step(logits, noise, want, temp, top_k)
    n_got = sample_commit(logits, noise, got, b, temp, top_k, chunk_v=chunk_v)
    assert torch.equal(n_got, n_want)
    _assert_same_rows(got, want)
    col = torch.where(n_want > 0, rows.n_gen[:b], rows.cap)
    return got.out_tok[torch.arange(b), col]


def _case(b: int, v: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, v, generator=g) * 3.0).to(dtype)
    return logits, torch.empty(b, v).exponential_(generator=g)


# (B, V, chunk): 4 chunks each, the last one ragged (top-k V - 1 = 249 raises the chunk to its 256 candidates)
SHAPES = [(1, 250, 64), (3, 1000, 256)]


@pytest.mark.parametrize(("temp", "dtype", "shape"), [
    *[(0.7, torch.bfloat16, shape) for shape in SHAPES],
    *[(1.0, torch.float32, shape) for shape in SHAPES],
    (0.6, torch.float16, SHAPES[1]),
], ids=["bf16-V250", "bf16-V1000", "fp32-V250", "fp32-V1000", "fp16-V1000"])
def test_sampled_equals_torch_path(shape: tuple[int, int, int], temp: float, dtype: torch.dtype) -> None:
    b, v, chunk = shape
    for i, top_k in enumerate([0, 1, 5, 50, v - 1, v]):
        logits, noise = _case(b, v, seed=10 * i + b, dtype=dtype)
        if not supported(top_k, v):  # V - 1 = 999 > MAX_TOP_K: the torch path's business
            with pytest.raises(ValueError, match="not supported"):
                sample_commit(logits, noise, _rows(4, 0), b, temp, top_k)
            continue
        _compare(logits, noise, temp, top_k, chunk, _rows(4, seed=i))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_equals_torch_path(dtype: torch.dtype) -> None:
    for b, v, chunk in SHAPES:
        logits, _ = _case(b, v, seed=b, dtype=dtype)
        logits[0, [7, 9, v - 3]] = logits[0].max() + 1.0  # ties for the max in a chunk and across: the first
        tok = _compare(logits, None, 0.0, 50, chunk, _rows(4, seed=b))  # top_k is ignored when greedy
        assert int(tok[0]) == 7


def test_all_equal_logits_keep_every_column() -> None:
    """top_k 5 of an all-equal row keeps all V (every chunk is full of ties at kth: all rescanned): the winner is
    the noise's argmin and p = 1 / V."""
    logits = torch.zeros(2, 256)
    noise = torch.empty(2, 256).exponential_(generator=torch.Generator().manual_seed(3))
    tok = _compare(logits, noise, 0.8, 5, 64, _rows(2, seed=1))
    assert torch.equal(tok, noise.argmin(dim=-1))


def test_ties_at_kth_spread_over_chunks() -> None:
    """k = 5 (8 candidates per chunk of 32): 3 columns at 5.0, 12 at 2.0 = the k-th value, so 15 are kept. Chunk 2
    holds a 5.0 and 9 ties (more than it stores: rescanned), 3 ties sit in other chunks (stored). Each row's noise
    makes one column win: ties (73: one that chunk 2 did not store; 10; 255) and a 5.0. Then an exact race tie."""
    v = 256
    logits = torch.randn(v, generator=torch.Generator().manual_seed(5)) - 20.0
    logits[[3, 70, 200]] = 5.0
    ties = [10, 64, 65, 66, 67, 68, 69, 71, 72, 73, 100, 255]
    logits[ties] = 2.0
    rows_logits = logits.expand(4, v).contiguous()
    noise = torch.ones(4, v)
    for r, col in enumerate([73, 10, 255, 3]):
        noise[r, col] = 1e-4  # wins by far: a tie's p is e^-3 of a 5.0's, its 1 / e is 1e4 times the others'
    tok = _compare(rows_logits, noise, 1.0, 5, 32, _rows(4, seed=2))
    assert tok.tolist() == [73, 10, 255, 3]
    # equal noise and 5.0 only at 70 (rescanned chunk 2) and 200 (stored, raced first): an exact race tie, the
    # first column wins
    logits[3] = -20.0
    tok = _compare(logits[None].clone(), torch.ones(1, v), 1.0, 5, 32, _rows(1, seed=3))
    assert tok.tolist() == [70]


def _next_up(x: torch.Tensor) -> torch.Tensor:
    """The next representable value above x > 0 in x's dtype."""
    bits = torch.int16 if x.element_size() == 2 else torch.int32
    return (x.view(bits) + 1).view(x.dtype)


# (dtype, T, where to look for a): distinct raw logits meet at one s = x / T only where fp32 rounds coarser than the
# raw format: below fp32's normal range for 16-bit logits (huge T), at any T for fp32
COLLAPSE = [(torch.bfloat16, 2.0**20, 2.0**-125), (torch.float16, 2.0**127, 2.0**-14), (torch.float32, 0.7, 1.9)]


@pytest.mark.parametrize(("dtype", "temp", "start"), COLLAPSE, ids=["bf16", "fp16", "fp32"])
def test_kth_s_reached_from_below_the_kth_raw_logit(dtype: torch.dtype, temp: float, start: float) -> None:
    """k = 5 (8 candidates per chunk of 32) on raw values: 4 at hi, one at c (the 5th largest raw value, col 10) and
    11 at a < c with a / T == c / T: all 16 are kept. 10 a's fill chunk 4 (cols 130..139, it stores 130..137): its
    raw values all lie below the k-th raw value, yet its smallest s is the k-th s, so it must be rescanned (a rescan
    rule on raw values would drop 138 and 139). The a at 210 is a stored candidate of a chunk not rescanned (kept by
    its s, not its raw value). Each row's noise makes one column win: 139 (not stored), 130, 10, a hi, 210."""
    v = 256
    a = torch.tensor([start], dtype=dtype)
    while (a.float() / temp != _next_up(a).float() / temp).item():  # a few steps at most
        a = _next_up(a)
    c = _next_up(a)
    assert a.item() < c.item() and torch.equal(a.float() / temp, c.float() / temp)
    logits = torch.full((v,), -20.0, dtype=dtype)
    logits[[3, 70, 200, 250]] = 4.0  # above a and c for every start
    logits[10] = c.item()
    logits[[*range(130, 140), 210]] = a.item()
    winners = [139, 130, 10, 200, 210]
    rows_logits = logits.expand(len(winners), v).contiguous()
    noise = torch.ones(len(winners), v)
    for r, col in enumerate(winners):
        noise[r, col] = 1e-4
    tok = _compare(rows_logits, noise, temp, 5, 32, _rows(len(winners), seed=6))
    assert tok.tolist() == winners


@triton.jit
def _keys_kernel(x_ptr, key_ptr, back_ptr, N, BITS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < N)
    u = sc._key(x, BITS)
    tl.store(key_ptr + i, u, mask=i < N)
    tl.store(back_ptr + i, sc._from_key(u, x), mask=i < N)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_sort_keys_follow_the_raw_order(dtype: torch.dtype) -> None:
    """The radix select's keys: every non-NaN 16-bit pattern (fp32: 4096 random ones and the specials) gets a
    distinct key in [0, 2^bits) in the floats' order (-0.0 just below +0.0), and `_from_key` inverts it bit-exactly."""
    bits = 8 * torch.empty(0, dtype=dtype).element_size()
    if bits == 16:
        pattern = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    else:
        g = torch.Generator().manual_seed(0)
        pattern = torch.cat([torch.randint(-(2**31), 2**31, (4096,), generator=g, dtype=torch.int64).to(torch.int32),
                             torch.tensor([0, -(2**31), 0x7F800000, -8388608, 1, -(2**31) + 1], dtype=torch.int32)])
    x = pattern.view(dtype)
    x = x[~torch.isnan(x)]
    key = torch.empty(x.numel(), dtype=torch.int32 if bits == 16 else torch.int64)
    back = torch.empty_like(x)
    _keys_kernel[(1,)](x, key, back, x.numel(), BITS=bits, BLOCK=triton.next_power_of_2(x.numel()))
    assert torch.equal(back.view(pattern.dtype), x.view(pattern.dtype))
    assert int(key.min()) >= 0 and int(key.max()) < 2**bits
    order = key.argsort()
    sorted_key, sorted_x = key[order], x[order].double()
    assert bool((sorted_key[1:] > sorted_key[:-1]).all())  # distinct
    assert bool((sorted_x[1:] >= sorted_x[:-1]).all())  # in the floats' order
    zeros = (sorted_x == 0).nonzero().flatten()  # -0.0 then +0.0
    assert torch.signbit(sorted_x[zeros]).tolist() == [True, False]


@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_commit_rules_and_rows_past_the_batch(temp: float) -> None:
    """Row 0 plain, 1 done, 2 emits one of its EOS ids, 3 reaches max_new_tokens, 4 had no budget left (finishes,
    emits nothing); rows 5 and 6 are not in the batch and keep every value."""
    b, v = 5, 300
    logits, noise = _case(b, v, seed=7, dtype=torch.bfloat16)
    rows = _rows(7, seed=4)
    probe = RowState(7, 64, 16, 4, torch.device("cpu"))
    probe.restore(rows.snapshot())
    _torch_step(logits, noise, probe, temp, 5)
    tok2 = int(probe.out_tok[2, int(rows.n_gen[2])])  # the token row 2 will draw: make it an EOS id
    rows.done[1] = True
    rows.eos[2, :3] = torch.tensor([v + 1, tok2, 0 if tok2 else 1])
    rows.max_new[3] = rows.n_gen[3] + 1
    rows.max_new[4] = rows.n_gen[4]
    rows.done[5:] = True
    rows.out_tok[5:] = 9
    before = rows.snapshot()
    _compare(logits, noise, temp, 5, 64, rows)
    got = RowState(7, 64, 16, 4, torch.device("cpu"))
    got.restore(before)
    n = sample_commit(logits, noise, got, b, temp, 5, chunk_v=64)
    assert n.tolist() == [1, 0, 1, 1, 0]
    assert got.done.tolist() == [False, True, True, True, True, True, True]
    assert all(torch.equal(t[5:], s[5:]) for t, s in zip(got.tensors(), before, strict=True))


@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_row_offset_commits_rows_from_row0(temp: float) -> None:
    """row0 = 2 (prefill's first tokens, after two active rows): logits row i commits row 2 + i as the torch path's
    commit of slice(2, 4) does; rows 0, 1 and 4 keep every value."""
    logits, noise = _case(2, 300, seed=5, dtype=torch.float32)
    rows = _rows(5, seed=6)
    want = RowState(5, 64, 16, 4, torch.device("cpu"))
    want.restore(rows.snapshot())
    if temp <= 0.0:
        tok, lp = choose_greedy(logits)
    else:
        probs, lsm = process(logits, Mode("uniform", temp, 1.0, 5), *[torch.empty(0)] * 3)  # uniform: reads no row
        tok, lp = choose_sampled(probs, noise, lsm, want.temp[2:4])
    n_want = want.commit_no_sync(slice(2, 4), tok[:, None], lp[:, None], torch.ones_like(tok))
    n_got = sample_commit(logits, noise if temp > 0 else None, rows, 2, temp, 5, row0=2, chunk_v=64)
    assert torch.equal(n_got, n_want)
    _assert_same_rows(rows, want)
    assert bool((n_got == 1).all())


def test_supported_top_k() -> None:
    assert supported(0, 49152) and supported(49152, 49152) and supported(-1, 100)
    assert supported(256, 49152) and not supported(257, 49152)  # MAX_TOP_K
    assert supported(127, 151936) and not supported(128, 151936)  # the candidates fit one finish tile
    assert supported(249, 250) and not supported(999, 1000)
    assert sc._chunk_for(256, 49152) == 4096 and sc._chunk_for(50, 49152) == 2048


def _decode(mode_params: RequestSampling, fused_sampler: bool, steps: int,
            monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], int]:
    """Prefill 3 rows of a tiny model, then `steps` plain decode steps through a DecodeStep whose fused flag is on
    (torch forward: fused_max_seqs=0) -> (row state, sample_commit calls)."""
    calls: list[int] = []

    def spy(*args: object, **kw: object) -> torch.Tensor:
        calls.append(1)
        return sample_commit(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sc, "sample_commit", spy)
    model = tiny_target()
    engine = Engine(model, eos_ids=(), config=EngineConfig(max_len=48, max_slots=4, seed=11))  # torch step
    engine.state.step = DecodeStep(model, engine.cache, engine.rows, fused=True, fused_max_seqs=0,
                             fused_sampler=fused_sampler)
    prompts = random_prompts(3, seed=8)
    reqs = [Request(p, RequestSampling(temperature=mode_params.temperature, top_k=mode_params.top_k,
                                      max_new_tokens=(2, 4, 9)[i])) for i, p in enumerate(prompts)]
    engine.prefill([(i, 0) for i in range(3)], reqs)
    mode = sampling_mode([r.params for r in reqs])
    assert engine.step.samples_fused(mode) is fused_sampler
    for _ in range(steps):
        engine.decode_step(3)
    return engine.rows.tensors(), len(calls)


@pytest.mark.parametrize("params", [RequestSampling(temperature=0.0), RequestSampling(temperature=0.8, top_k=20)])
def test_decode_step_routes_and_matches_torch(params: RequestSampling, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's first tokens and 5 steps (rows 0 and 1 reach their 2 and 4 new tokens on the way, then commit
    nothing): the fused sampler's row state is the torch path's, with the same draws from the rows' own streams."""
    want, n_torch = _decode(params, False, 5, monkeypatch)
    got, n_fused = _decode(params, True, 5, monkeypatch)
    assert (n_torch, n_fused) == (0, 6)  # the prefill's first tokens, then 5 steps
    names = ["lens", "last", "n_gen", "done", "max_new", "prompt_len", "group", "temp", "top_p", "top_k", "eos",
             "key", "out_tok", "out_lp"]
    for name, g, w in zip(names, got, want, strict=True):
        if name == "out_lp":
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0.0)
        else:
            assert torch.equal(g, w), name
    assert got[names.index("done")][:3].tolist() == [True, True, False]


def test_samples_fused_says_which_path_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_target()  # vocabulary 320
    engine = Engine(model, eos_ids=(), config=EngineConfig(max_len=32, max_slots=2))
    on = DecodeStep(model, engine.cache, engine.rows, fused=True)
    assert on.samples_fused(GREEDY) and on.samples_fused(Mode("uniform", 0.8, 1.0, 20))
    assert on.samples_fused(Mode("uniform", 0.8, 1.0, 0)) and on.samples_fused(Mode("uniform", 0.8, 1.0, 320))
    assert not on.samples_fused(Mode("uniform", 0.8, 0.9, 20))  # top-p: torch
    assert not on.samples_fused(Mode("uniform", 0.8, 1.0, 300))  # k > MAX_TOP_K: torch
    assert not on.samples_fused(MIXED)
    assert on.samples_fused(Mode("uniform", 0.8, 1.0, 20), 512)
    previous = configure(KernelConfig(sampler_max_batch=8))  # larger batches take the torch path
    try:
        assert on.samples_fused(GREEDY, 8) and not on.samples_fused(GREEDY, 9)
        assert on.samples_fused(Mode("uniform", 0.8, 1.0, 20), 8) and not on.samples_fused(Mode("uniform", 0.8, 1.0, 20), 9)
    finally:
        configure(previous)
    assert not DecodeStep(model, engine.cache, engine.rows, fused=True,
                          fused_sampler=False).samples_fused(GREEDY)
    assert not DecodeStep(model, engine.cache, engine.rows).samples_fused(GREEDY)  # torch forward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run compiled, alone with -m gpu")
@pytest.mark.parametrize("b", [1, 8])
def test_gpu_smollm2_vocab_bf16_and_graph_replay(b: int) -> None:
    """V = 49152, bf16 logits, 20 seeds x (greedy; T = 1, top-k 0 and 50; T = 0.7, top-k 50): the torch path's row
    state; then sample_commit captured in a CUDA graph and replayed on fresh logits and noise gives the eager
    result."""
    v = 49152
    for seed in range(20):
        for temp, top_k in [(0.0, 0), (1.0, 0), (1.0, 50), (0.7, 50)]:
            logits, noise = _case(b, v, seed, torch.bfloat16)
            _compare(logits.cuda(), noise.cuda(), temp, top_k, None, _rows(b + 2, seed, "cuda"))
    for temp, top_k in [(0.0, 0), (1.0, 0), (1.0, 50)]:
        logits, noise = (t.cuda() for t in _case(b, v, 99, torch.bfloat16))
        rows = _rows(b + 2, 5, "cuda")
        start = rows.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            sample_commit(logits, noise, rows, b, temp, top_k)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            n_graph = sample_commit(logits, noise, rows, b, temp, top_k)
        fresh_logits, fresh_noise = (t.cuda() for t in _case(b, v, 100, torch.bfloat16))
        logits.copy_(fresh_logits)
        noise.copy_(fresh_noise)
        rows.restore(start)
        graph.replay()
        eager = RowState(rows.slots, 64, 16, 4, torch.device("cuda"))
        eager.restore(start)
        n_eager = sample_commit(fresh_logits, fresh_noise, eager, b, temp, top_k)
        torch.cuda.synchronize()
        assert torch.equal(n_graph, n_eager)
        _assert_same_rows(rows, eager)
